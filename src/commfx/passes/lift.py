"""lift: recognise MoE regions in a captured graph and spell them with canonical ops.

Regions are found through `nn_module_stack`: every node a module's forward produced
belongs to that module's region. Each recogniser below is one table entry: which module
it matches, and what the region means in canonical ops. The experts region becomes
`moe_dispatch -> expert_ffn -> moe_combine`; a softmax top-k router region becomes
`topk_router`. A router no entry matches (group-limited, sigmoid, biased...) is kept
verbatim: its outputs feed the canonical ops unchanged, so such families keep working.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.commfx)
from ..plan import Plan
from ..compiler.program import Program, module_paths
from ..compiler.precision import region_compute_dtype
from ..compiler.regions import MoEBlock
from ..compiler.rewrite import Rewriter
from .base import Pass, PassError, register
from .lift_embeddings import lift_embeddings
from .lift_heads import lift_heads

commfx = torch.ops.commfx


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class ExpertsPattern:
    """Experts stored as 3-D gated weights [E, 2I, H] and [E, H, I] (F.linear layout)."""

    name: str
    matches: Callable[[type, nn.Module | None], bool]
    gate_up: str  # parameter holding [E, 2I, H] (gate rows first)
    down: str  # parameter holding [E, H, I]
    activation: Callable[[nn.Module | None, list[fx.Node]], str]


def _is_builtin_experts(cls: type, module: nn.Module | None) -> bool:
    from ..models.gpt_moe import Experts

    return cls is Experts


# The layout flags `use_experts_implementation` sets on each experts instance, as the gated
# pattern needs them: [E, 2I, H] gate-then-up rows, [E, H, I] down, no biases, no norm after.
HF_GATED_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True, "has_post_expert_norm": False}
# Flags a supported transformers release predates, and what their absence means there
# (5.17-5.23 have no post-expert norm, so no `has_post_expert_norm`).
HF_FLAGS_ADDED_LATER = {"has_post_expert_norm": False}
_ABSENT = object()


def _is_hf_gated_experts(cls: type, module: nn.Module | None) -> bool:
    """HF v5 experts made by `use_experts_implementation` with the default layout."""
    if not hasattr(cls, "_apply_gate") or "transformers" not in cls.__module__:
        return False
    from transformers.integrations.moe import _default_apply_gate

    default_gate = getattr(cls._apply_gate, "__func__", cls._apply_gate) is _default_apply_gate
    if module is None:
        # The compile backend sees classes only: the layout flags live on instances, but a
        # custom gate (gpt-oss's clamped, biased one) shows on the class.
        return default_gate
    return default_gate and all(
        getattr(module, flag, HF_FLAGS_ADDED_LATER.get(flag, _ABSENT)) == wanted for flag, wanted in HF_GATED_LAYOUT.items()
    )


def _activation_from_region(module: nn.Module | None, region: list[fx.Node]) -> str:
    names = {getattr(n.target, "__name__", str(n.target)) for n in region if n.op in ("call_function", "call_method")}
    for activation in ("silu", "gelu", "relu"):
        if activation in names:
            return activation
    raise PassError(f"cannot tell the experts' activation from the ops {sorted(names)}")


EXPERTS_PATTERNS: tuple[ExpertsPattern, ...] = (
    ExpertsPattern("commfx built-in Experts", _is_builtin_experts, "gate_up_proj", "down_proj", lambda m, r: "silu"),
    ExpertsPattern("HF v5 gated experts (batched_mm/grouped_mm)", _is_hf_gated_experts, "gate_up_proj", "down_proj", _activation_from_region),
)

# Routers: softmax -> top-k (-> renormalise). Ops a matching region may contain besides
# the logits computation; anything else means the router is of another kind.
ROUTER_OPS = {"softmax", "topk", "getitem", "float", "to", "sum", "truediv", "itruediv", "div", "_to_copy"}


def looks_like_moe(cls: type) -> bool:
    name = cls.__name__.lower()
    return "expert" in name or "moe" in name


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, ExpertsPattern | None]]:
    """(path, module, matching pattern or None) for each experts-like module of `model`."""
    found = []
    for path, module in model.named_modules():
        pattern = next((p for p in EXPERTS_PATTERNS if p.matches(type(module), module)), None)
        if pattern is not None:
            found.append((path, module, pattern))
        elif looks_like_moe(type(module)) and any(p.dim() == 3 for p in module.parameters(recurse=False)):
            found.append((path, module, None))
    return found


# ---------------------------------------------------------------------------- the pass


@register("lift", ensures=("moe lifted", "embeddings lifted"))
class Lift(Pass):
    """Spell MoE blocks (router, experts) with canonical commfx ops; enabling pass.

    Recognisers are the EXPERTS_PATTERNS table; unmatched MoE-looking modules are reported.
    Embedding lookups become commfx.embedding (recognisers in lift_embeddings.py); an LM head
    whose logits feed only a cross-entropy loss is recorded for split_embedding_comm (lift_heads.py).
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        lift_routers: bool = True

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        rw = Rewriter(program, "lift")
        blocks, unmatched, candidates = [], [], []
        for path, (cls, nodes) in _regions(program.graph).items():
            module = program.module_at(path)
            pattern = next((p for p in EXPERTS_PATTERNS if p.matches(cls, module)), None)
            if pattern is not None:
                blocks.append(_lift_experts(rw, path, nodes, pattern, module))
            elif looks_like_moe(cls) and _uses_3d_weight(nodes):
                candidates.append((path, cls, nodes))
        lifted_weights = {w for b in blocks for w in (b.gate_up, b.down)}
        for path, cls, nodes in candidates:
            if any(n.op == "get_attr" and n.target not in lifted_weights and _is_3d(n) for n in nodes):
                unmatched.append(f"{path} ({cls.__name__})")
        kept_routers = []
        if options.lift_routers:
            for block in blocks:
                if not _lift_router(rw, block):
                    kept_routers.append(block.router or block.path)
        if unmatched:
            warnings.warn(
                "lift: these modules look like MoE experts but no recogniser matches them, so they stay "
                f"unlifted (and are not expert-parallel): {', '.join(unmatched)}. "
                "Add an entry to commfx.passes.lift.EXPERTS_PATTERNS for their layout.",
                stacklevel=2,
            )
        regions = program.regions
        regions.moe_blocks, regions.unmatched_moe, regions.kept_routers = blocks, unmatched, kept_routers
        regions.embeddings, regions.kept_embeddings = lift_embeddings(program, rw)
        regions.lm_heads, regions.kept_heads = lift_heads(program, regions.embeddings)
        rw.finish()
        return bool(blocks or regions.embeddings)


def _regions(graph: fx.Graph) -> dict[str, tuple[type, list[fx.Node]]]:
    """Every module path -> (its class, the nodes traced inside it, in graph order)."""
    regions: dict[str, tuple[type, list[fx.Node]]] = {}
    for node in graph.nodes:
        for path, cls in module_paths(node):
            regions.setdefault(path, (cls, []))[1].append(node)
    return regions


def _uses_3d_weight(nodes: list[fx.Node]) -> bool:
    return any(node.op == "get_attr" and _is_3d(node) for node in nodes)


def _is_3d(node: fx.Node) -> bool:
    value = _value(node)
    return value is not None and value.dim() == 3


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _lift_experts(rw: Rewriter, path: str, nodes: list[fx.Node], pattern: ExpertsPattern, module) -> MoEBlock:
    graph = rw.graph
    inside = set(nodes)
    compute = [n for n in nodes if n.op not in ("get_attr", "placeholder")]
    outputs = [n for n in compute if _value(n) is not None and any(u not in inside for u in n.users)]
    if len(outputs) != 1:
        raise PassError(f"lift: experts region {path} has {len(outputs)} outputs ({[o.name for o in outputs]}); expected one")
    external = []
    for n in compute:
        for arg in n.all_input_nodes:
            if arg not in inside and arg not in external and _value(arg) is not None:
                external.append(arg)
    _refuse_routing_from_outside(path, compute)
    x, indices, weights = _classify_experts_inputs(path, external)
    gate_up = _param_node(graph, f"{path}.{pattern.gate_up}" if path else pattern.gate_up)
    down = _param_node(graph, f"{path}.{pattern.down}" if path else pattern.down)
    num_experts = _value(gate_up).shape[0]
    activation = pattern.activation(module, compute)
    make = rw.maker(outputs[0])
    # A region computing in a lower precision than its input (Plan.precision) dispatches rows
    # in that precision: the all-to-alls move them so, and the experts compute in it.
    compute_dtype, out_dtype = region_compute_dtype(compute), _value(outputs[0]).dtype
    with rw.before(outputs[0]):
        if compute_dtype is not None and compute_dtype != _value(x).dtype:
            x = make("to", (x, compute_dtype), f"experts compute in {str(compute_dtype).removeprefix('torch.')}", op="call_method")
            x.meta["example_value"] = _value(x.args[0]).to(compute_dtype)
        dispatch = make(commfx.moe_dispatch.default, (x, indices, num_experts, 0.0), "lay tokens out by expert")
        rows = make(operator.getitem, (dispatch, 0))
        counts = make(operator.getitem, (dispatch, 1))
        slot = make(operator.getitem, (dispatch, 2))
        ffn = make(commfx.expert_ffn.default, (rows, counts, gate_up, down, activation), "experts")
        combine = make(commfx.moe_combine.default, (ffn, slot, weights), "weighted combine")
        result = combine
        if compute_dtype is not None and compute_dtype != out_dtype:
            result = make("to", (combine, out_dtype), "the region's output dtype", op="call_method")
            result.meta["example_value"] = _value(outputs[0])
    rw.replace(outputs[0], result, erase=False)
    rw.erase_dead(compute)
    return MoEBlock(
        path=path, pattern=pattern.name, num_experts=num_experts, top_k=_value(indices).shape[1], gate_up=gate_up.target,
        down=down.target, activation=activation, router=_router_path(indices), dispatch=dispatch, experts=[ffn], combine=combine,
    )


def _refuse_routing_from_outside(path: str, compute: list[fx.Node]) -> None:
    """Expert indices that are an input of the graph came from another graph: under
    torch.compile (no fullgraph) dynamo cut the model between the router and its experts."""
    entering = {a for n in compute for a in n.all_input_nodes if a.op == "placeholder"}  # graph inputs, whatever module they sit in
    routed = [a for a in entering if _graph_input_value(a) is not None and not _graph_input_value(a).is_floating_point()
              and _graph_input_value(a).dim() == 2]
    if not routed:
        return
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', next((n.meta.get("stack_trace") or "" for n in compute), ""))
    where = ""
    if frames:  # dynamo names the graph after a break torch_dynamo_resume_in_<function>_at_<line of the break>
        file, line, function = frames[0]
        resumed = re.fullmatch(r"torch_dynamo_resume_in_(\w+)_at_(\d+)", function)
        where = f" at {file}:{resumed[2]} in {resumed[1]}" if resumed else f" before {file}:{line} in {function}"
    raise PassError(
        f"lift: a graph break{where}, between the router and the experts at {path}: dynamo cut the model there, so the experts' "
        "top-k indices enter this graph from the previous one and commfx cannot rewrite the router and its experts together. "
        "Remove the break (a print, .item(), .tolist() or data-dependent Python control flow between them); "
        "torch.compile(model, fullgraph=True) or torch._dynamo.explain(model)(*inputs) names its line"
    )


def _graph_input_value(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None and "grapharg" in node.meta:
        value = getattr(node.meta["grapharg"], "example", None)
    return value if isinstance(value, torch.Tensor) else None


def _classify_experts_inputs(path: str, external: list[fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Tell hidden states, expert indices and routing weights apart by dtype and shape."""
    tensors = [n for n in external if n.op != "get_attr"]
    indices = [n for n in tensors if not _value(n).is_floating_point() and _value(n).dim() == 2]
    if len(indices) != 1:
        raise PassError(f"lift: cannot find the top-k expert indices entering {path}")
    shape = tuple(_value(indices[0]).shape)
    weights = [n for n in tensors if _value(n).is_floating_point() and tuple(_value(n).shape) == shape]
    hidden = [n for n in tensors if _value(n).is_floating_point() and n not in weights and _value(n).dim() == 2]
    if len(weights) != 1 or len(hidden) != 1:
        raise PassError(f"lift: cannot tell hidden states from routing weights entering {path}")
    return hidden[0], indices[0], weights[0]


def _param_node(graph: fx.Graph, target: str) -> fx.Node:
    for node in graph.nodes:
        if node.op == "get_attr" and node.target == target:
            return node
    raise PassError(f"lift: parameter {target} is not used by the graph")


def _router_path(indices: fx.Node) -> str | None:
    paths = module_paths(indices)
    return paths[-1][0] if paths else None


def _lift_router(rw: Rewriter, block: MoEBlock) -> bool:
    """Replace a softmax top-k router region with commfx.topk_router; False if it is another kind."""
    graph = rw.graph
    path = block.router
    if path is None:
        return False
    nodes = [n for n in graph.nodes if any(p == path for p, _ in module_paths(n)) and n.op not in ("get_attr", "placeholder")]
    topks = [n for n in nodes if getattr(n.target, "__name__", n.target) == "topk"]
    softmaxes = [n for n in nodes if getattr(n.target, "__name__", n.target) == "softmax"]
    if len(topks) != 1 or len(softmaxes) != 1:
        return False
    topk, softmax = topks[0], softmaxes[0]
    if _strip_casts(topk.args[0]) is not softmax:
        return False
    logits = _strip_casts(softmax.args[0])
    logits_side = _ancestors_within(logits, set(nodes))
    for node in nodes:
        name = getattr(node.target, "__name__", str(node.target))
        if node not in logits_side and name not in ROUTER_OPS:
            return False
    inside = set(nodes)
    outs = [n for n in nodes if _value(n) is not None and any(u not in inside for u in n.users) and n not in logits_side]
    indices = [n for n in outs if not _value(n).is_floating_point()]
    weights = [n for n in outs if _value(n).is_floating_point()]
    if len(indices) != 1 or len(weights) != 1:
        return False
    k = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")
    divides = {"truediv", "itruediv", "div"}
    normalize = any(getattr(n.target, "__name__", str(n.target)) in divides for n in _ancestors_within(weights[0], set(nodes)))
    score_dtype = _value(softmax).dtype
    make = rw.maker(topk)
    with rw.before(weights[0] if weights[0].prev is not None else indices[0]):
        router = make(commfx.topk_router.default, (logits, k, normalize, score_dtype), "softmax top-k router")
        new_weights = make(operator.getitem, (router, 0))
        new_indices = make(operator.getitem, (router, 1))
    new_weights.meta["example_value"] = _value(weights[0])
    new_indices.meta["example_value"] = _value(indices[0])
    _move_after_inputs(graph, [router, new_weights, new_indices], logits)
    out_dtype = _value(weights[0]).dtype
    if out_dtype != score_dtype:
        with rw.after(new_weights):
            cast = rw.method("to", (new_weights, out_dtype))
        cast.meta["example_value"] = _value(weights[0])
        rw.replace(weights[0], cast, erase=False)
    else:
        rw.replace(weights[0], new_weights, erase=False)
    rw.replace(indices[0], new_indices, erase=False)
    rw.erase_dead([n for n in nodes if n not in logits_side])
    return True


def _strip_casts(node):
    while isinstance(node, fx.Node) and getattr(node.target, "__name__", node.target) in ("float", "to", "_to_copy"):
        node = node.args[0]
    return node


def _ancestors_within(node: fx.Node, region: set[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen or current not in region:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return seen


def _move_after_inputs(graph: fx.Graph, new_nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Place new nodes right after `anchor` so every later use comes after them."""
    for node in reversed(new_nodes):
        anchor.append(node)
