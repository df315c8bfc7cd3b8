"""Unit migration, taker side: the slot parameters that hold the units a rank computes for
another (`UnitSlots`), the blocks whose units can move (`UnitBlock`), and the
`commfx.tp_units` op, which adds the taken units' partial product to the row-parallel one
before the all-reduce (`units_forward`, `units_backward`). Moving units between steps is
the `Resizer`'s (`move_units`)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..comm import current_scheduler
from .linear_plan import units_key


class UnitSlots(torch.nn.Module):
    """The units a rank computes for another: one parameter per moved weight, sized by the
    current migration (empty when it takes none). Loading takes the saved sizes."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, param in self._parameters.items():
            saved = state_dict.get(prefix + name)
            if saved is not None and saved.shape != param.shape:
                param.data = param.data.new_empty(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


@dataclass
class UnitBlock:
    """One tp block whose units can move: its unit function (the tensor_parallel pass's), the
    weights a unit spans and, on a taker, the slot parameters holding the units it computes.

    `tensors[i]` = (weight, dim, layout): the unit's rows (dim 0: a column linear's weight
    and bias) or columns (dim 1: the row linear's weight), cut by this rank's layout
    (outer, units per rank, inner). A unit function takes the weights in this order."""

    key: str  # the row linear's weight (the block's name in plans and state)
    graph: fx.GraphModule
    kinds: str  # per outside input of the unit function: "t" a tensor, "s" a size
    tensors: list[tuple[str, int, list[int]]]
    per_rank: int  # parts per rank (a part: a head, a kv group, an MLP column)
    unit: int  # parts per unit
    slots: list[torch.nn.Parameter] = field(default_factory=list, repr=False)
    taken: int = 0  # units this rank computes for another (in its slots)
    stash: list = field(default_factory=list, repr=False)  # forward -> backward: the vjp of the taken units

    @property
    def units(self) -> int:
        return self.per_rank // self.unit

    def index(self, layout: list[int], first: int, count: int) -> torch.Tensor:
        """Indices, along a weight's dim, of units first..first+count-1 of this rank's shard, in
        the order the unit function takes them (outer x heads/columns x inner); a unit spans
        per / units of this weight's heads (under grouped-query attention a q weight's unit
        has more heads than a k/v weight's)."""
        return self.order_index(layout, range(first, first + count))

    def order_index(self, layout: list[int], order) -> torch.Tensor:
        """Indices, along a weight's dim, that put the units of this rank's shard in `order`
        (position i takes unit order[i]) within each outer part (q, k, v of a fused weight)."""
        outer, per, inner = layout
        size = per // self.units
        parts = torch.tensor([u * size + j for u in order for j in range(size)], dtype=torch.long)
        return torch.arange(outer * per * inner).view(outer, per, inner)[:, parts, :].reshape(-1)


def units_forward(partial: torch.Tensor, tensors: list[torch.Tensor], sizes: list[int], key: str, group: str) -> torch.Tensor:
    """The row-parallel partial product plus, on a taker, the partial products of the units it
    computes for another rank: the unit function on the block's replicated inputs and the
    slots (every unit taken, in one call)."""
    block = current_scheduler().op_state.get(units_key(key))
    if block is None or not block.taken:
        return partial.clone()
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point()]

    def units(float_inputs, weights):
        swapped = list(tensors)
        for i, t in zip(floating, float_inputs):
            swapped[i] = t
        t_iter, s_iter = iter(swapped), iter(sizes)
        inputs = [next(t_iter) if kind == "t" else next(s_iter) for kind in block.kinds]
        return block.graph(block.taken * block.unit, *inputs, *weights)  # every unit taken, in one call

    with _autograd_inside_op():
        float_inputs = [tensors[i].detach().requires_grad_() for i in floating]
        weights = [p.detach().requires_grad_() for p in block.slots]
        out = units(float_inputs, weights)
    block.stash.append((float_inputs, weights, out))
    del block.stash[:-STASH]  # forwards without a backward (evaluation) leave nothing behind
    return partial + out.detach()


STASH = 4
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor)


@contextmanager
def _autograd_inside_op():
    """Autograd back on inside a custom op's implementation, which runs below it (its dispatch
    keys excluded): a taker records its units' own graph in forward and differentiates it in
    backward. (torch.func.vjp works there too, at about 1.5x the cost on CPU.)"""
    old = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    try:
        for k in _AUTOGRAD_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(_AUTOGRAD_KEYS, old):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def units_backward(grad: torch.Tensor, tensors: list[torch.Tensor], key: str, group: str) -> list[torch.Tensor]:
    """Gradients for the units' inputs (zero on a rank that computes none); the slots'
    gradients are accumulated into their `.grad` (they are not graph inputs)."""
    block = current_scheduler().op_state.get(units_key(key))
    grads = [t.new_zeros(t.shape) for t in tensors]
    if block is None or not block.taken or not block.stash:
        return grads
    float_inputs, weights, out = block.stash.pop()
    with _autograd_inside_op():
        found = torch.autograd.grad(out, [*float_inputs, *weights], grad, allow_unused=True)
    for i, g in zip([i for i, t in enumerate(tensors) if t.is_floating_point()], found[: len(float_inputs)]):
        if g is not None:
            grads[i] = g
    for slot, g in zip(block.slots, found[len(float_inputs) :]):
        if g is not None:
            slot.grad = g if slot.grad is None else slot.grad + g
    return grads
