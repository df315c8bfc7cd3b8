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
