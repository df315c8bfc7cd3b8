"""Primitive forms of commfx's compute ops, for compiled regions.

A custom op is one opaque call to Inductor: nothing around it fuses into it, and aot_autograd
cannot see what its backward recomputes. Under `Plan(compute="inductor")` lowering hands
aot_autograd this table, so the MoE ops open into aten ops (indexing, softmax, top-k, the
activation and gating product) around the grouped GEMMs, which stay ops of their own
(`ops/grouped_gemm.py`). Inductor then fuses the gathers and pointwise work with their
neighbours, and the joint graph's common-subexpression pass merges the hidden layer the
experts' backward recomputes with the forward's: the partitioner saves it (a GEMM is never
recomputed), so the backward runs one grouped GEMM fewer, unless an activation memory budget
says otherwise. The packed experts' op (`ops/packed.py`, Lina's packing) opens the same
way: on a GPU over all V*k of its assignments, the invalid ones padding that the grouped
GEMMs leave out, so no shape depends on the routing and nothing is read back to the host;
on the CPU over the valid ones only (`_cut_padding`). The packed exchange's glue (metadata
columns on the rows, the sum of returned rows, their gradients) opens too, so it fuses into
the gathers beside it. Each form computes what its op computes, in the same order of
additions (but packed_expert_ffn's sum of a row's k expert outputs); communication ops are
never opened (they bound the regions). `compute="interpret"` keeps the ops whole.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import embedding, moe, packed
from .grouped_gemm import grouped_mm

commfx = torch.ops.commfx


def _scatter_rows(rows: torch.Tensor, slot: torch.Tensor, num_tokens: int, k: int) -> torch.Tensor:
    """moe_scatter_rows as a gather and a sum over each token's k assignments (no scatter,
    so no atomic adds: deterministic), dropped assignments adding zeros."""
    return moe._gather_assignments(rows, slot).view(num_tokens, k, rows.shape[1]).sum(dim=1)


def _dispatch(x, indices, num_experts, capacity_factor, capacity_floor=None):
    """Dropless dispatch (its row count is known: N*k); capacity mode stays an op (its row
    count depends on a measured floor)."""
    if capacity_factor > 0:
        return NotImplemented
    row_token, counts, slot = moe._dispatch_layout(indices, num_experts, capacity_factor)
    return x.index_select(0, row_token), counts, slot


def _cut_padding(device: torch.device) -> bool:
    """Whether the packed experts' layout holds only the valid assignments: on the CPU, where
    reading their count back costs nothing and the padding would still pass through every
    gather and pointwise op around the GEMMs (a third of the assignments at top-2 on two
    ranks, half at top-8); not on a GPU, where the read would stall the stream."""
    return device.type == "cpu"


def _packed_layout(local_ids: torch.Tensor, local_experts: int):
    """packed_expert_ffn's assignments laid out by local expert: the valid ones grouped by
    expert (row order within one, as the op lays them out). With `_cut_padding`, only those
    (their count read back once); otherwise all V*k of them with a static shape and no host
    sync, the invalid ones (id -1) last, as padding past sum(counts) that the grouped GEMMs
    leave out (`ops/grouped_gemm.py`). Returns (order: the flat assignment of each laid-out
    row, counts [L], slot [V, k]: each assignment's row, valid [V, k], or None where the
    padding is cut and slot counts from 1, 0 naming a zero row: see `_per_row`)."""
    flat = local_ids.reshape(-1)
    valid = flat >= 0
    expert = torch.where(valid, flat, local_experts)  # the padding "expert" L sorts last
    order = torch.argsort(expert, stable=True)
    counts = moe.expert_counts(expert, local_experts + 1)[:local_experts]
    slot = torch.empty_like(order).scatter(0, order, torch.arange(order.numel(), device=order.device))
    if not _cut_padding(local_ids.device):
        return order, counts, slot.view_as(local_ids), valid.view_as(local_ids)
    assigned = counts.sum().item()
    torch._check(assigned >= 0)
    torch._check(assigned <= flat.numel())
    return order[:assigned], counts, torch.where(valid, slot + 1, 0).view_as(local_ids), None


def _per_row(laid: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """[V, k, ...]: each assignment's laid-out row, zeros where it is invalid (`where`: a
    padding row's value is unspecified; a zero row put first where the padding is cut);
    gathered, so no scatter and no atomic adds."""
    if valid is None:
        return torch.cat([laid.new_zeros((1,) + laid.shape[1:]), laid])[slot]
    picked = laid[slot]
    return torch.where(valid.view(valid.shape + (1,) * (picked.dim() - 2)), picked, 0)


def _packed_expert_ffn(x, local_ids, weights, gate_up, down, activation):
    """packed_expert_ffn as a gather of each assignment's row, the grouped expert FFN over
    the assignments `_packed_layout` lays out and, per row, the sum
    of its weighted expert outputs (over its k choices, in choice order: the op adds them
    in expert order, which differs only in rounding for k > 2)."""
    k = local_ids.shape[1]
    order, counts, slot, valid = _packed_layout(local_ids, gate_up.shape[0])
    gate_up, down = moe.in_rows_dtype(x, gate_up, down)
    gate, up = grouped_mm(x.index_select(0, order // k), gate_up, counts).chunk(2, dim=-1)
    y = grouped_mm(moe.ACTIVATIONS[activation](gate) * up, down, counts)
    return (_per_row(y, slot, valid) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


def _packed_expert_ffn_backward(grad_out, x, local_ids, weights, gate_up, down, activation):
    """packed_expert_ffn_backward on the same layout: the hidden layer it recomputes is the
    forward's (the joint graph's common-subexpression pass merges the two), and the rows'
    and routing weights' gradients are gathered back per assignment and summed per row."""
    k = local_ids.shape[1]
    order, counts, slot, valid = _packed_layout(local_ids, gate_up.shape[0])
    row = order // k
    laid = x.index_select(0, row)
    masters = gate_up, down
    gate_up, down = moe.in_rows_dtype(x, gate_up, down)
    hidden = grouped_mm(laid, gate_up, counts)
    grad_laid, grad_gate_up, grad_down, grad_laid_weights = moe.weighted_expert_ffn_backward(
        grad_out.index_select(0, row), weights.reshape(-1)[order], laid, hidden, counts, gate_up, down, activation)
    grad_x = _per_row(grad_laid, slot, valid).sum(dim=1)
    grad_weights = _per_row(grad_laid_weights, slot, valid)  # remote experts' weights: zero gradient here
    return grad_x, grad_weights, grad_gate_up.to(masters[0].dtype), grad_down.to(masters[1].dtype)


def _attach_meta(rows, meta):
    """attach_meta where the metadata has the rows' dtype: a concatenation, fused with the
    gathers that make the rows (other dtypes are bit-cast: the op stays)."""
    if meta.dtype != rows.dtype:
        return NotImplemented
    return torch.cat([rows, meta], dim=1)


def _detach_meta(payload, meta_like):
    """detach_meta where the metadata has the rows' dtype: slices of the received payload, read
    in place by the expert FFN's gathers instead of copied out first."""
    if meta_like.dtype != payload.dtype:
        return NotImplemented
    meta_cols, k = meta_like.shape[1], meta_like.shape[1] // 2
    hidden = payload.shape[1] - meta_cols
    return payload[:, :hidden], payload[:, hidden : hidden + k], payload[:, hidden + k :].round().to(torch.int64)


def _body(op) -> Callable:
    """The Python implementation a `torch.library.custom_op` was defined with: traced, it is
    the op's aten form."""
    return op._init_fn


def compute_decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """Op overload -> its primitive form, for aot_autograd's `decompositions`."""
    return {
        commfx.topk_router.default: _body(moe.topk_router),
        commfx.moe_dispatch.default: _dispatch,
        commfx.moe_scatter_rows.default: _scatter_rows,
        commfx.moe_combine.default: _body(moe.moe_combine),
        commfx.moe_combine_backward.default: _body(moe.moe_combine_backward),
        commfx.group_by_expert.default: moe.regroup,
        commfx.expert_ffn.default: _body(moe.expert_ffn),
        commfx.expert_ffn_backward.default: _body(moe.expert_ffn_backward),
        commfx.packed_expert_ffn.default: _packed_expert_ffn,
        commfx.packed_expert_ffn_backward.default: _packed_expert_ffn_backward,
        commfx.embedding.default: _body(embedding.embedding),
        commfx.attach_meta.default: _attach_meta,
        commfx.detach_meta.default: _detach_meta,
        commfx.scatter_add_tokens.default: _body(packed.scatter_add_tokens),
        commfx.rank_dispatch_backward.default: _body(packed.rank_dispatch_backward),
    }
