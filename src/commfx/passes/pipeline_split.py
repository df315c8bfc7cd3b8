"""pipeline_split: cut the graph into pipeline stages, one graph module per stage.

The model's repeated layers (the longest `prefix.<i>` module list in `nn_module_stack`:
`layers.0`, `model.layers.3`, ...) are dealt out to `pp` stages in contiguous blocks, by
count or by a FLOP estimate. What comes before the first layer (embeddings) joins the
first stage, what comes after the last (final norm, head, loss) the last. Every value a
later stage needs crosses the boundaries in between as a named tensor (the `Boundary`
objects of `compiler.stages`); size computations (`sym_size` of an input) are recomputed
in each stage that needs them, so only tensors ever travel. A weight used by two stages
(a tied embedding) is held by both, and its gradient is summed across them. After
tensor_parallel, each stage keeps its blocks' tp collectives, which run on the `tp` group
of that stage's ranks; boundary values are whole (replicated over tp), and each tp rank
sends its copy to the rank of the next stage with its tp index.

torch.fx's `split_module` does the same cut, but threads the symbolic sizes themselves
between partitions as inputs; a SymInt cannot travel between ranks as a tensor, and its
symbol bookkeeping made a cycle of our symbolic-batch graphs. So stages are extracted here
with `Graph.node_copy`, the way `split_module` builds its partitions.

(GPipe, Huang et al., NeurIPS 2019; 1F1B from PipeDream-Flush, Narayanan et al., SC 2021;
the substrate of Optimus-CC, Song et al., ASPLOS 2023.)
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import torch
import torch.fx as fx

from ..compiler.program import Program, module_paths
from ..compiler.stage_split import assign_stages, build_pipeline, parent_module
from ..cost.flops import hint, node_flops
from ..plan import Plan, PlanError
from .base import DEFERRED, Pass, PassError, register
from .defer_grad_sync import REFUSED as DEFER_REFUSED

PASS = "pipeline_split"
SCHEDULES = ("1f1b", "gpipe")
BALANCES = ("layers", "flops")
_LAYER = re.compile(r"^(.*?)\.?(\d+)$")


@register(PASS, ensures="pipeline split", refuses={
    **Pass.refuses,
    DEFERRED: DEFER_REFUSED["pipeline split"],
    "resizable tensor parallel": "resize_tp's straggler controller runs in the whole-model runtime, not inside pipeline stages; use resize_tp with --pp 1",
    "embedding comm": "split_embedding_comm's exchange spans every rank, but only the first and last stages hold embeddings and head; use it with --pp 1",
})
class PipelineSplit(Pass):
    """Cut the graph into `pp` pipeline stages with named boundaries (GPipe / 1F1B).

    Stages are lowered and run on their own ranks; see compiler/stages.py and runtime/pipeline/.
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        schedule: str = "1f1b"  # or gpipe
        microbatches: int = 0  # 0: as many as stages
        balance: str = "layers"  # layers: equal layer counts; flops: equal estimated FLOPs per stage

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.schedule not in SCHEDULES:
            raise PlanError(f"pipeline_split schedule={options.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if options.balance not in BALANCES:
            raise PlanError(f"pipeline_split balance={options.balance!r} is not one of {', '.join(BALANCES)}")
        if options.microbatches < 0:
            raise PlanError(f"pipeline_split microbatches must be >= 1 (0: one per stage), got {options.microbatches}")
        pp = plan.topology.pp
        if pp < 2:
            raise PlanError("pipeline_split needs at least 2 pipeline stages; set the pipeline-parallel size (--pp 2)")
        if model is not None:
            layers = count_model_layers(model)
            if layers == 0:  # name what was expected and the model's own repeated (outermost, non-torch) modules
                from collections import Counter

                counts = Counter(type(m) for m in model.modules())
                repeated = [(n, type(m)) for n, m in model.named_modules() if n and counts[type(m)] > 1 and not type(m).__module__.startswith("torch.")]
                outer = [(n, cls) for n, cls in repeated if not any(n.startswith(p + ".") for p, _ in repeated)]
                found = "; ".join(f"{', '.join(n for n, c in outer if c is cls)} ({cls.__name__})" for cls in dict.fromkeys(c for _, c in outer))
                raise PlanError(
                    f"pipeline_split deals out an nn.ModuleList of blocks named like layers.0, layers.1 (or model.layers.<i>) "
                    f"to the {pp} stages; {type(model).__name__} has none; its repeated modules are {found or 'none'}. "
                    "Keep the blocks in an nn.ModuleList (self.layers = nn.ModuleList([...]))"
                )
            if layers < pp:
                raise PlanError(
                    f"{type(model).__name__} has {layers} layer(s) to deal out but the plan asks for {pp} pipeline "
                    f"stages; every stage needs a layer: use --pp {max(1, layers)} or fewer"
                )

    @classmethod
    def evidence(cls, program: Program, options: Options) -> dict[str, int]:
        pipeline = program.regions.pipeline
        if pipeline is None or len(pipeline.stages) < 2:
            return {}
        return {"stages": len(pipeline.stages), "boundaries": len(pipeline.boundaries)}

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        pp = plan.topology.pp
        graph = program.graph
        prefix, layer_of = find_layers(graph)
        num_layers = len({i for i in layer_of.values()})
        if num_layers < pp:
            raise PassError(
                f"the graph has {num_layers} layer(s) ({prefix or '?'}.<i>) but the plan asks for {pp} pipeline stages; "
                f"use --pp {max(1, num_layers)} or fewer"
            )
        microbatches = options.microbatches or pp
        _check_microbatches(graph, microbatches)
        if options.balance == "flops":
            layer_stage = balance_by_flops(graph, layer_of, pp)
        else:
            layer_stage = balance_by_count(num_layers, pp)
        stage_of = assign_stages(graph, layer_of, layer_stage)
        pipeline = build_pipeline(program, stage_of, pp, layer_stage)
        pipeline.schedule, pipeline.microbatches = options.schedule, microbatches
        program.regions.pipeline = pipeline
        program.gm = parent_module(program, pipeline)
        return True


# ------------------------------------------------------------------------------ layers


def find_layers(graph: fx.Graph) -> tuple[str, dict[fx.Node, int]]:
    """The longest module list `prefix.<i>` the graph runs, and each node's layer index in it."""
    indices: dict[str, set[int]] = defaultdict(set)
    for node in graph.nodes:
        for path, _cls in module_paths(node):
            match = _LAYER.match(path)
            if match:
                indices[match.group(1)].add(int(match.group(2)))
    if not indices:
        raise PassError(
            "pipeline_split found no repeated layers (modules named like layers.0, layers.1, ...) to cut between; "
            "keep the model's blocks in an nn.ModuleList"
        )
    prefix = max(indices, key=lambda p: (len(indices[p]), -len(p)))
    layer_of: dict[fx.Node, int] = {}
    pattern = re.compile(rf"^{re.escape(prefix)}\.?(\d+)(\.|$)" if prefix else r"^(\d+)(\.|$)")
    for node in graph.nodes:
        for path, _cls in module_paths(node):
            match = pattern.match(path)
            if match:
                layer_of[node] = int(match.group(1))
                break
    order = sorted(set(layer_of.values()))
    renumber = {layer: i for i, layer in enumerate(order)}
    return prefix, {node: renumber[layer] for node, layer in layer_of.items()}


def count_model_layers(model: torch.nn.Module) -> int:
    """The blocks this pass can deal out to stages: the longest nn.ModuleList (0: none)."""
    lists = [len(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, default=0)


def balance_by_count(num_layers: int, stages: int) -> dict[int, int]:
    """Contiguous blocks of (nearly) equal size; earlier stages take the remainder (the last
    stage also runs the head and the loss)."""
    sizes = [num_layers // stages + (1 if s < num_layers % stages else 0) for s in range(stages)]
    out, layer = {}, 0
    for stage, size in enumerate(sizes):
        for _ in range(size):
            out[layer] = stage
            layer += 1
    return out


def balance_by_flops(graph: fx.Graph, layer_of: dict[fx.Node, int], stages: int) -> dict[int, int]:
    """Contiguous blocks that minimise the largest stage's estimated FLOPs (what comes before
    the first layer counts for the first stage, what comes after the last for the last)."""
    num_layers = len(set(layer_of.values()))
    cost = [0.0] * num_layers
    before = after = 0.0
    seen_layer = False
    for node in graph.nodes:
        flops = node_flops(node)
        if node in layer_of:
            cost[layer_of[node]] += flops
            seen_layer = True
        elif seen_layer:
            after += flops
        else:
            before += flops
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def block(i: int, j: int, stage: int) -> float:  # layers [i, j) on `stage`
        return prefix[j] - prefix[i] + (before if stage == 0 else 0.0) + (after if stage == stages - 1 else 0.0)

    # best[s][j]: the smallest possible largest-stage cost of layers [0, j) on stages 0..s
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(stages)]
    cut = [[0] * (num_layers + 1) for _ in range(stages)]
    for j in range(1, num_layers + 1):
        best[0][j] = block(0, j, 0)
    for s in range(1, stages):
        for j in range(s + 1, num_layers + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], block(i, j, s))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    out, j = {}, num_layers
    for s in reversed(range(stages)):
        i = cut[s][j] if s else 0
        for layer in range(i, j):
            out[layer] = s
        j = i
    return out


def _check_microbatches(graph: fx.Graph, microbatches: int) -> None:
    """The example batch must cut into equal micro-batches (the runtime checks every step too)."""
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim():
            rows = hint(value.shape[0])
            if rows % microbatches:
                raise PassError(
                    f"this rank's batch has {rows} rows, which do not cut into {microbatches} equal micro-batches; "
                    f"choose pipeline_split:microbatches from {[d for d in range(1, rows + 1) if rows % d == 0]} "
                    "or a batch that divides"
                )
            return
