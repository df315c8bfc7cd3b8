"""Where a model computes in a lower precision on purpose.

Some models keep a region in a lower precision whatever the model's dtype: DeepSeek casts
its router to float32 (`F.linear(x.type(torch.float32), w.type(torch.float32))`), Ernie
stores its router weight in float32. In a float64 equivalence run, the gradient of such a
parameter is a sum over tokens taken in float32, and summing each rank's tokens first
changes the float32 rounding: a difference near float32's epsilon that is not a bug.

This finds those parameters from the captured graph (a parameter stored in, or cast to, a
floating dtype coarser than the run's, before any compute) so `verify` can judge exactly
those gradients at that dtype's tolerance and everything else at its own.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

# Ops that only change a tensor's dtype or view: a cast seen through these still feeds compute.
_PASS_THROUGH = {"type", "to", "float", "half", "bfloat16", "_to_copy", "view", "reshape", "t", "transpose", "contiguous"}


@dataclass(frozen=True)
class LowPrecision:
    dtype: torch.dtype
    reason: str


def low_precision_parameters(gm: fx.GraphModule, run_dtype: torch.dtype) -> dict[str, LowPrecision]:
    """Parameter name -> the coarser dtype its gradient is computed in, with why."""
    found: dict[str, LowPrecision] = {}
    run_eps = torch.finfo(run_dtype).eps
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = gm.get_parameter(node.target)
        except AttributeError:
            continue  # a buffer or constant: it has no gradient
        if not value.requires_grad or not value.is_floating_point():
            continue
        if torch.finfo(value.dtype).eps > run_eps:
            found[node.target] = LowPrecision(value.dtype, f"stored in {_name(value.dtype)}")
            continue
        dtype = _coarsest_cast(node, run_eps)
        if dtype is not None:
            found[node.target] = LowPrecision(dtype, f"cast to {_name(dtype)} before use")
    return found


def _coarsest_cast(node: fx.Node, run_eps: float) -> torch.dtype | None:
    coarsest, frontier, seen = None, [node], set()
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user in seen or _op_name(user) not in _PASS_THROUGH:
                continue
            seen.add(user)
            dtype = _dtype_of(user)
            if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).eps > run_eps:
                if coarsest is None or torch.finfo(dtype).eps > torch.finfo(coarsest).eps:
                    coarsest = dtype
            frontier.append(user)
    return coarsest


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return name.split(".")[0] if node.op == "call_function" and "." in name else name


def _dtype_of(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return getattr(value, "dtype", None)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ mixed precision (a plan setting)
# `Plan(precision="bf16")`: parameters stay float32 (the masters the optimizer steps); the
# captured graph computes as torch.autocast would, with the casts written into the graph, so
# every pass after capture sees bfloat16 activations and every all-to-all moves bfloat16 rows.
# Matmuls (linears, attention, the experts' FFNs) run in bfloat16; norms, softmax, the router
# and the loss stay in float32 (HF and Megatron keep them so). Gradients of the float32
# masters come out float32 (the backward of a cast casts back), so they are reduced in float32.

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

# torch-level ops autocast runs in the lower precision: every floating argument is cast to it
_COMPUTE_FUNCTIONS = {
    torch.nn.functional.linear, torch._C._nn.linear, torch.matmul, torch.bmm, torch.mm, torch.baddbmm, torch.addmm,
    torch.addbmm, torch.einsum, torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
    operator.matmul,
}
_COMPUTE_METHODS = {"matmul", "bmm", "mm", "baddbmm", "addmm", "__matmul__"}
# Library ops (`torch.ops.<namespace>.<name>`, any namespace) that are matmuls, by name. Grouped
# GEMMs are the experts of HF's `grouped_mm` implementation, which commfx keeps on CUDA: under
# dynamo with float32 weights they trace as `transformers::grouped_mm_fallback`, otherwise as
# `aten::_grouped_mm`. Left out, no cast reaches the experts and they compute in float32.
_COMPUTE_OP_NAMES = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_grouped_mm", "grouped_mm", "grouped_mm_fallback"}
_COMPUTE_FUNCTIONS.update(f for f in (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None)) if f)
# ops kept in float32 whatever they are given: norms, softmax, the loss
_FP32_FUNCTIONS = {
    torch.softmax, torch.nn.functional.softmax, torch.log_softmax, torch.nn.functional.log_softmax,
    torch.nn.functional.layer_norm, torch.layer_norm, torch.nn.functional.group_norm, torch.nn.functional.cross_entropy,
    torch.nn.functional.nll_loss, torch.nn.functional.mse_loss,
}
_FP32_METHODS = {"softmax", "log_softmax"}
if hasattr(torch.nn.functional, "rms_norm"):
    _FP32_FUNCTIONS.add(torch.nn.functional.rms_norm)


# Passes that cannot take a mixed-precision graph yet, and why (the pass manager refuses them by name).
REFUSED_UNDER_MIXED_PRECISION: dict[str, str] = {
    "resize_tp": "its unit functions re-plan tensor_parallel's blocks from float32 linears, and do not read through the bf16 casts yet",
}


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype a plan's `precision` names (PlanError-free: the plan checks the name)."""
    return PRECISIONS[precision]


def is_compute_op(node: fx.Node) -> bool:
    """A matmul-like node: what autocast runs in the lower precision."""
    if node.op == "call_function":
        return node.target in _COMPUTE_FUNCTIONS or _library_op_name(node.target) in _COMPUTE_OP_NAMES
    return node.op == "call_method" and node.target in _COMPUTE_METHODS


def _library_op_name(target) -> str | None:
    """`name` of a `torch.ops.<namespace>.<name>[.<overload>]` target, None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return None


def _is_fp32_op(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _FP32_FUNCTIONS
    return node.op == "call_method" and node.target in _FP32_METHODS


def region_compute_dtype(nodes) -> torch.dtype | None:
    """The dtype a region's matmuls compute in, where the precision transform cast them
    (None elsewhere: a model's own casts are left as lift always left them): lift keeps it,
    so such a region dispatches bfloat16 rows."""
    nodes = [n for n in nodes if isinstance(n, fx.Node)]
    if not any((n.meta.get("commfx") or {}).get("pass") == "precision" for n in nodes):
        return None
    for node in nodes:
        if is_compute_op(node):
            value = _dtype_of(node)
            if value is not None and value.is_floating_point:
                return value
    return None


def router_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Matmuls whose result reaches a top-k without passing another matmul: routers' logits."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if _op_name(node) != "topk":
            continue
        frontier, seen = [a for a in node.all_input_nodes], set()
        while frontier:
            current = frontier.pop()
            if current in seen:
                continue
            seen.add(current)
            if is_compute_op(current):
                found.add(current)
                continue
            frontier.extend(current.all_input_nodes)
    return found


def apply_precision(gm: fx.GraphModule, precision: str) -> int:
    """Write `precision`'s casts into a captured torch-level graph (see above); returns the
    number of casts. "fp32" changes nothing. The graph's outputs keep their dtypes (the loss
    and logits a caller sees stay float32). Fake values are recomputed, in dynamo's fake
    mode, for every node whose inputs changed dtype, so later passes read true dtypes."""
    if precision == "fp32":
        return 0
    low = PRECISIONS[precision]
    graph = gm.graph
    routers = router_nodes(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    original_out = {value: _dtype_of(value) for value in _flat_nodes(output.args)}
    refresh = _Refresh(graph)
    casts = 0
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if is_compute_op(node):
            want = torch.float32 if node in routers else low
        elif _is_fp32_op(node):
            want = torch.float32
        else:
            refresh(node)  # its inputs are up to date: every earlier node was visited
            continue
        made = _cast_inputs(graph, node, want)
        for cast in made:
            refresh(cast)
        refresh(node, force=bool(made))
        casts += len(made)
    for value, dtype in original_out.items():
        now = _dtype_of(value)
        if dtype is not None and now is not None and now != dtype:
            with graph.inserting_before(output):
                cast = graph.call_method("to", (value, dtype))
            cast.meta["nn_module_stack"] = dict(value.meta.get("nn_module_stack", {}))
            _stamp(cast, dtype)
            refresh(cast)
            output.args = fx.node.map_arg(output.args, lambda n, v=value, c=cast: c if n is v else n)
            casts += 1
    graph.lint()
    gm.recompile()
    return casts


def _flat_nodes(args) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda n: found.append(n) or n)
    return found


def _stamp(node: fx.Node, dtype: torch.dtype) -> None:
    node.meta["commfx"] = {"pass": "precision", "purpose": f"compute in {_name(dtype)}"}


def _cast_inputs(graph: fx.Graph, node: fx.Node, want: torch.dtype) -> list[fx.Node]:
    """Cast every floating tensor argument of `node` that is not `want` (the cast takes the
    node's module stack, so regions keep their casts); returns the casts."""
    made: list[fx.Node] = []

    def cast(arg):
        dtype = _dtype_of(arg)
        if dtype is None or not dtype.is_floating_point or dtype == want:
            return arg
        with graph.inserting_before(node):
            new = graph.call_method("to", (arg, want))
        new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack", {}))
        _stamp(new, want)
        made.append(new)
        return new

    node.args = fx.node.map_arg(node.args, cast)
    node.kwargs = fx.node.map_arg(node.kwargs, cast)
    return made


class _Refresh:
    """Recompute a node's fake value when it is new or an input's dtype changed."""

    def __init__(self, graph: fx.Graph):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensor

        # The mode of the graph's own fake values (under torch.compile's backend the tracing
        # context may hold another one).
        values = [n.meta.get("example_value") for n in graph.nodes if n.op in ("placeholder", "get_attr")]
        self.mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None) or detect_fake_mode(
            [v for v in values if isinstance(v, torch.Tensor)]
        )
        self.changed: set[fx.Node] = set()

    def __call__(self, node: fx.Node, force: bool = False) -> None:
        fresh = "example_value" not in node.meta
        if not (fresh or force or any(a in self.changed for a in node.all_input_nodes)):
            return
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("example_value"))
        with self.mode:
            if node.op == "call_function":
                value = node.target(*args, **kwargs)
            else:
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
        old = node.meta.get("example_value")
        node.meta["example_value"] = value
        if fresh or _dtypes(old) != _dtypes(value):
            self.changed.add(node)


def _dtypes(value):
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(_dtypes(v) for v in value)
    return None
