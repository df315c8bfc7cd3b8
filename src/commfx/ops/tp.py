"""Canonical tensor-parallel ops (Megatron's f and g), handing their all-reduce to the runtime.

Megatron-LM splits a block (attention, MLP) into column-parallel linears, whose outputs
each rank computes for its own heads or columns from the replicated input, and one
row-parallel linear, whose partial products over those columns are summed over the
tensor-parallel group. Two conjugate ops carry the communication:

- `tp_copy(x, group)` (Megatron's f) marks where the replicated input enters the block:
  identity forward; backward sums the input gradient over the group, since each rank only
  back-propagates through its own columns.
- `all_reduce(x, group)` (Megatron's g) sums the row-parallel partial products; backward is
  the identity (every rank already holds the whole output gradient).

Groups are named, as elsewhere in commfx, so the graph is the same on every rank.
"""

from __future__ import annotations

import torch

from ..runtime.comm import current_scheduler
from .autocast import register_autocast
from ..runtime.resize.linear import linear_backward, linear_forward
from ..runtime.resize.units import units_backward, units_forward


def shard_index(layout: tuple[int, int, int] | list[int], part: int, parts: int) -> torch.Tensor:
    """Indices of the dim that part `part` of `parts` holds under `layout` (outer, units, inner)."""
    outer, units, inner = layout
    if units % parts:
        raise ValueError(f"{units} units do not divide into {parts} parts")
    per = units // parts
    grid = torch.arange(outer * units * inner).view(outer, units, inner)
    return grid[:, part * per : (part + 1) * per, :].reshape(-1)


@torch.library.custom_op("commfx::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """Sum of `x` over the ranks of `group` (a new tensor; `x` is not touched)."""
    out = x.contiguous().clone()
    return current_scheduler().all_reduce(out, group, kind="tp_all_reduce")


@all_reduce.register_fake
def _(x, group, tag=""):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx, inputs, output):
    pass


all_reduce.register_autograd(lambda ctx, grad: (grad, None, None), setup_context=_all_reduce_setup)


@torch.library.custom_op("commfx::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity; its gradient is summed over `group` (see module docstring)."""
    return x.clone()


@tp_copy.register_fake
def _(x, group):
    return torch.empty_like(x)


def _tp_copy_setup(ctx, inputs, output):
    ctx.group = inputs[1]


tp_copy.register_autograd(
    lambda ctx, grad: (all_reduce(grad, ctx.group, "input gradient"), None), setup_context=_tp_copy_setup
)



# ------------------------------------------------------------------ resizable tp linears


@torch.library.custom_op("commfx::tp_linear", mutates_args=())
def tp_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str, group: str) -> torch.Tensor:
    """A column- or row-parallel linear whose contraction width is runtime state (`resize_tp`):
    all columns (plain tp), a kept subset (ZERO-resizing) or some computed by a faster rank of
    `group` (migration). The output has the plain linear's shape on every rank either way."""
    return linear_forward(x, weight, bias, key, group)


@tp_linear.register_fake
def _(x, weight, bias, key, group):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("commfx::tp_linear_backward", mutates_args=())
def tp_linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, key: str, group: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `tp_linear` under the same runtime plan: dropped columns imputed zero, so
    the input gradient keeps its shape (the tp all-reduce that follows sees the same tensor on
    every rank); the bias gradient is empty when there is no bias."""
    return linear_backward(grad, x, weight, has_bias, key, group)


@tp_linear_backward.register_fake
def _(grad, x, weight, has_bias, key, group):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty((weight.shape[0],) if has_bias else (0,))


def _tp_linear_setup(ctx, inputs, output):
    x, weight, bias, key, group = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias, ctx.key, ctx.group = bias is not None, key, group


def _tp_linear_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw, gb = tp_linear_backward(grad, x, weight, ctx.has_bias, ctx.key, ctx.group)
    return gx, gw, gb if ctx.has_bias else None, None, None


tp_linear.register_autograd(_tp_linear_grad, setup_context=_tp_linear_setup)
register_autocast(torch.ops.commfx.tp_linear.default, (0, 1, 2))  # as F.linear: input, weight, bias


# ------------------------------------------------------------------------ migrated units


@torch.library.custom_op("commfx::tp_units", mutates_args=())
def tp_units(partial: torch.Tensor, inputs: list[torch.Tensor], sizes: list[int], key: str, group: str) -> torch.Tensor:
    """A row-parallel partial product plus those of the units this rank computes for a slower
    rank of `group` (`resize_tp` unit migration: each unit end to end from the block's
    replicated `inputs` and `sizes`); `partial` unchanged where it computes none. Placed
    before the row-parallel all-reduce, so every rank's collective keeps its shape."""
    return units_forward(partial, inputs, sizes, key, group)


@tp_units.register_fake
def _(partial, inputs, sizes, key, group):
    return torch.empty_like(partial)


@torch.library.custom_op("commfx::tp_units_backward", mutates_args=())
def tp_units_backward(grad: torch.Tensor, inputs: list[torch.Tensor], key: str, group: str) -> list[torch.Tensor]:
    """Gradients of `tp_units` for its `inputs` (zeros where this rank computes no unit); the
    units' own weights (the runtime's slots) get theirs directly."""
    return units_backward(grad, inputs, key, group)


@tp_units_backward.register_fake
def _(grad, inputs, key, group):
    return [torch.empty_like(t) for t in inputs]


def _tp_units_setup(ctx, inputs, output):
    partial, tensors, sizes, key, group = inputs
    ctx.save_for_backward(*tensors)
    ctx.floating = [t.is_floating_point() for t in tensors]
    ctx.key, ctx.group, ctx.sizes = key, group, len(sizes)


def _tp_units_grad(ctx, grad):
    grads = tp_units_backward(grad, list(ctx.saved_tensors), ctx.key, ctx.group)
    return grad, [g if f else None for g, f in zip(grads, ctx.floating)], None if ctx.sizes else [], None, None


tp_units.register_autograd(_tp_units_grad, setup_context=_tp_units_setup)
