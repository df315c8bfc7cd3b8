"""Primitive forms of commfx's compute ops, for compiled regions.

A custom op is one opaque call to Inductor: nothing around it fuses into it, and aot_autograd
cannot see what its backward recomputes. Under `Plan(compute="inductor")` lowering hands
aot_autograd this table, so the MoE ops open into aten ops (indexing, softmax, top-k, the
activation and gating product) around the grouped GEMMs, which stay ops of their own
(`ops/grouped_gemm.py`). Inductor then fuses the gathers and pointwise work with their
neighbours, and the joint graph's common-subexpression pass merges the hidden layer the
experts' backward recomputes with the forward's: the partitioner saves it (a GEMM is never
recomputed), so the backward runs one grouped GEMM fewer, unless an activation memory budget
says otherwise. Each form computes what its op computes, in the same order of additions;
communication ops are never opened (they bound the regions). `compute="interpret"` keeps
the ops whole.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import embedding, moe

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
        commfx.embedding.default: _body(embedding.embedding),
    }
