"""pipeline_split: cut the graph into pipeline stages, one graph module per stage.

The model's repeated layers (the longest `prefix.<i>` module list in `nn_module_stack`:
`layers.0`, `model.layers.3`, ...) are dealt out to `pp` stages in contiguous blocks, by
count or by a FLOP estimate. What comes before the first layer (embeddings) joins the
first stage, what comes after the last (final norm, head, loss) the last. Every value a
later stage needs crosses the boundaries in between as a named tensor (the `Boundary`
objects of `compiler.stages`); size computations (`sym_size` of an input) are recomputed
in each stage that needs them, so only tensors ever travel. A weight used by two stages
(a tied embedding) is held by both, and its gradient is summed across them.

torch.fx's `split_module` does the same cut, but threads the symbolic sizes themselves
between partitions as inputs; a SymInt cannot travel between ranks as a tensor, and its
symbol bookkeeping made a cycle of our symbolic-batch graphs. So stages are extracted here
with `Graph.node_copy`, the way `split_module` builds its partitions.

(GPipe, Huang et al., NeurIPS 2019; 1F1B from PipeDream-Flush, Narayanan et al., SC 2021;
the substrate of Optimus-CC, Song et al., ASPLOS 2023.)
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections import defaultdict

import torch
import torch.fx as fx

from ..compiler.program import Program, module_paths
from ..compiler.rewrite import Rewriter
from ..compiler.stages import INPUT_PREFIX, Boundary, BoundaryTensor, Pipeline, Stage
from ..plan import Plan, PlanError
from .base import Pass, PassError, register

PASS = "pipeline_split"
SCHEDULES = ("1f1b", "gpipe")
BALANCES = ("layers", "flops")
_LAYER = re.compile(r"^(.*?)\.?(\d+)$")


@register
class PipelineSplit(Pass):
    """Cut the graph into `pp` pipeline stages with named boundaries (GPipe / 1F1B).

    Stages are lowered and run on their own ranks; see compiler/stages.py and runtime/pipeline/.
    """

    name = PASS
    ensures = ("pipeline split",)

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
            layers = _count_model_layers(model)
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


def _count_model_layers(model: torch.nn.Module) -> int:
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


def node_flops(node: fx.Node) -> float:
    """A matmul-family node's FLOPs from its traced shapes (2 x output elements x the
    contracted size); other nodes count as free."""
    name = getattr(node.target, "__name__", str(node.target))
    value = node.meta.get("example_value")
    if node.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor):
        return 0.0
    first = node.args[0].meta.get("example_value") if node.args and isinstance(node.args[0], fx.Node) else None
    if name in ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm") and isinstance(first, torch.Tensor):
        return 2.0 * _numel(value) * _hint(first.shape[-1])
    if name == "scaled_dot_product_attention" and isinstance(first, torch.Tensor):
        return 4.0 * _numel(first) * _hint(first.shape[-2])
    if name.startswith("expert_ffn"):
        gate_up = node.args[2].meta.get("example_value") if isinstance(node.args[2], fx.Node) else None
        if isinstance(gate_up, torch.Tensor) and isinstance(first, torch.Tensor):
            return 2.0 * _hint(first.shape[0]) * 1.5 * _hint(gate_up.shape[1]) * _hint(gate_up.shape[2])
    return 0.0


def _hint(size) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


def _numel(t: torch.Tensor) -> int:
    n = 1
    for size in t.shape:
        n *= _hint(size)
    return n


def _check_microbatches(graph: fx.Graph, microbatches: int) -> None:
    """The example batch must cut into equal micro-batches (the runtime checks every step too)."""
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim():
            rows = _hint(value.shape[0])
            if rows % microbatches:
                raise PassError(
                    f"this rank's batch has {rows} rows, which do not cut into {microbatches} equal micro-batches; "
                    f"choose pipeline_split:microbatches from {[d for d in range(1, rows + 1) if rows % d == 0]} "
                    "or a batch that divides"
                )
            return


# ------------------------------------------------------------------------------ stages


def _is_scalar(node: fx.Node) -> bool:
    """Size arithmetic (SymInt values): recomputed where needed, never sent."""
    value = node.meta.get("example_value")
    if node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int):
        return True
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and node.op != "placeholder"


def assign_stages(graph: fx.Graph, layer_of: dict[fx.Node, int], layer_stage: dict[int, int]) -> dict[fx.Node, int]:
    """Every compute node's stage: its layer's, else the stage of the last layer before it
    (so embeddings go first and the head last). getitem follows its source."""
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or _is_scalar(node):
            continue
        if node in layer_of:
            current = max(current, layer_stage[layer_of[node]])
            stage_of[node] = layer_stage[layer_of[node]]
        elif node.target is operator.getitem and node.args[0] in stage_of:
            stage_of[node] = stage_of[node.args[0]]
        else:
            stage_of[node] = current
    for node, stage in stage_of.items():
        for arg in node.all_input_nodes:
            if stage_of.get(arg, -1) > stage:
                raise PassError(
                    f"node {node.name} (stage {stage}) uses {arg.name} from the later stage {stage_of[arg]}: "
                    "the model's layers do not run in order; pipeline_split needs layers applied one after another"
                )
    return stage_of


def _needs_grad(program: Program) -> dict[fx.Node, bool]:
    """Whether a node's value is floating and downstream of a trainable parameter."""
    out: dict[fx.Node, bool] = {}
    for node in program.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "get_attr":
            attr = _attr(program.gm, node.target)
            out[node] = isinstance(attr, torch.Tensor) and attr.requires_grad
        elif node.op == "placeholder" or _is_scalar(node):
            out[node] = False
        else:
            floating = not isinstance(value, torch.Tensor) or value.is_floating_point()
            out[node] = floating and any(out.get(a, False) for a in node.all_input_nodes)
    return out


def _attr(gm: fx.GraphModule, target: str):
    owner = gm
    for part in target.split("."):
        owner = getattr(owner, part)
    return owner


def _input_name(program: Program, node: fx.Node) -> str:
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    names = program.input_names or [n.name for n in placeholders]
    return INPUT_PREFIX + names[placeholders.index(node)]


def build_pipeline(program: Program, stage_of: dict[fx.Node, int], stages: int, layer_stage: dict[int, int]) -> Pipeline:
    graph = program.graph
    output_node = next(n for n in graph.nodes if n.op == "output")
    flat_outputs: list[fx.Node] = []
    fx.node.map_arg(output_node.args[0], flat_outputs.append)
    last = stages - 1
    needs_grad = _needs_grad(program)

    # Which stages need each produced value (as a graph input, or as a model output).
    def sources(node: fx.Node) -> list[fx.Node]:
        """The values `node` reads, looking through recomputed size arithmetic."""
        found = []
        for arg in node.all_input_nodes:
            found.extend(sources(arg) if _is_scalar(arg) else [arg])
        return found

    consumers: dict[fx.Node, set[int]] = defaultdict(set)
    for node, stage in stage_of.items():
        for arg in sources(node):
            if arg.op not in ("placeholder", "get_attr") and stage_of[arg] != stage:
                consumers[arg].add(stage)
    for node in flat_outputs:
        if node.op == "get_attr":
            raise PassError(f"the model returns the parameter {node.target}; pipeline_split needs outputs computed from inputs")
        if node.op != "placeholder" and stage_of.get(node) != last:
            consumers[node].add(last)

    boundaries = []
    for k in range(stages - 1):
        carried = [n for n in graph.nodes if n in consumers and stage_of[n] <= k < max(consumers[n])]
        tensors = []
        for n in carried:
            value = n.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                raise PassError(f"value {n.name} crosses pipeline boundary {k} but is not a tensor ({type(value).__name__})")
            paths = module_paths(n)
            tensors.append(
                BoundaryTensor(n.name, value.dtype, needs_grad[n], paths[-1][0] if paths else "", str(list(value.shape)), value.dim())
            )
        boundaries.append(Boundary(k, tensors))

    result_stages = []
    held: dict[str, list[int]] = defaultdict(list)
    for s in range(stages):
        nodes = [n for n in graph.nodes if stage_of.get(n) == s]
        produced_needed = [n for n in nodes if n in consumers or (s == last and n in flat_outputs)]
        stage = _extract_stage(program, s, nodes, stage_of, produced_needed, boundaries[s - 1].names if s else [])
        stage.layers = sorted(layer for layer, st in layer_stage.items() if st == s)
        for name in stage.parameters:
            held[name].append(s)
        result_stages.append(stage)
    shared = {name: where for name, where in held.items() if len(where) > 1}
    model_outputs = [_input_name(program, n) if n.op == "placeholder" else n.name for n in flat_outputs]
    return Pipeline(result_stages, boundaries, model_outputs, shared=shared)


def _extract_stage(program: Program, s: int, nodes: list[fx.Node], stage_of, outputs: list[fx.Node], received: list[str]) -> Stage:
    """One stage's graph module: placeholders for model inputs and received values, its own
    nodes (with recomputed size arithmetic and its own view of the parameters), and a tuple
    of the values later stages need."""
    inside = set(nodes)
    locals_, externals = [], []

    def collect(arg: fx.Node) -> None:
        if arg in inside or arg.op == "get_attr":
            return
        if arg.op == "placeholder":
            if arg not in locals_:
                locals_.append(arg)
        elif _is_scalar(arg):
            for sub in arg.all_input_nodes:
                collect(sub)
        elif arg not in externals:
            externals.append(arg)

    for node in nodes:
        for arg in node.all_input_nodes:
            collect(arg)
    placeholder_order = [n for n in program.graph.nodes if n.op == "placeholder"]
    locals_.sort(key=placeholder_order.index)
    missing = [e.name for e in externals if e.name not in received]
    if missing:
        raise PassError(f"internal: stage {s} needs {missing}, which its boundary does not carry")
    externals.sort(key=lambda e: received.index(e.name))

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for node in locals_:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        inputs.append(_input_name(program, node))
    for node in externals:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        inputs.append(node.name)
    parameters: list[str] = []

    def value(arg: fx.Node) -> fx.Node:
        if arg in env:
            return env[arg]
        if arg.op == "get_attr":
            new = graph.get_attr(arg.target)
            if isinstance(_attr(program.gm, arg.target), torch.nn.Parameter):
                parameters.append(arg.target)
        elif _is_scalar(arg):
            new = graph.node_copy(arg, value)  # recomputed here (sizes never travel)
        else:
            raise PassError(f"internal: stage {s} reads {arg.name}, which it neither computes nor receives")
        new.meta = dict(arg.meta)
        env[arg] = new
        return new

    for node in nodes:
        env[node] = graph.node_copy(node, value)
    graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(program.gm, graph, class_name=f"Stage{s}")
    return Stage(s, gm, inputs, [n.name for n in outputs], parameters)


def parent_module(program: Program, pipeline: Pipeline) -> fx.GraphModule:
    """A graph that calls the stages in order: the whole model again, in one process (what
    `commfx dump` shows and what a single-process run of the split program computes)."""
    root = torch.nn.Module()
    graph = fx.Graph()
    rw = Rewriter(graph, PASS)
    env: dict[str, fx.Node] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            new = graph.placeholder(node.name)
            new.meta = dict(node.meta)
            env[_input_name(program, node)] = new
    for stage in pipeline.stages:
        name = f"stage_{stage.index}"
        root.add_module(name, stage.gm)
        call = rw.call(name, tuple(env[i] for i in stage.inputs), op="call_module", purpose=f"pipeline stage {stage.index}")
        for i, out in enumerate(stage.outputs):
            env[out] = rw.call(operator.getitem, (call, i))
    output_node = next(n for n in program.graph.nodes if n.op == "output")

    def resolve(node: fx.Node) -> fx.Node:
        return env[_input_name(program, node)] if node.op == "placeholder" else env[program.node(node.name).name]

    graph.output(fx.node.map_arg(output_node.args[0], resolve))
    return fx.GraphModule(root, graph, class_name="PipelineModel")
