"""Canonical ops for once-per-rank dispatch (Lina's expert packing; DeepEP's dispatch layout).

Plain expert parallelism sends one row per (token, expert) assignment: a top-2 token whose
two experts live on the same rank crosses the wire twice each way. Here a token goes to each
destination rank at most once, carrying its routing weights and the local ids of the experts
it needs there; the receiver fans it out to those experts and sums their weighted outputs,
so one row comes back. Dispatch and combine rows are the unique (token, destination rank)
pairs: the minimum for a placement.

    expert_slots       source: where each chosen expert lives now (the runtime's placement)
    rank_dispatch      source: token rows per destination rank, with weights and local ids
    attach_meta        source: the weights and ids as extra columns of the rows (one all-to-all)
    detach_meta        receiver: rows, weights and local ids again
    packed_expert_ffn  receiver: every local expert of every received row and their weighted
                       sum, fused (kernels/packed_experts.py: the Triton kernel on CUDA)
    masked_dispatch    receiver, unfused: rows laid out by local expert (id -1 skipped); then
    moe_combine        expert_ffn and the weighted sum per received row (slot -1 adds nothing)
    scatter_add_tokens source: sum the rows that came back into their tokens
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import grouped_mm, packed_experts
from ..runtime.expert_placement import current_placements
from .autocast import register_autocast
from .moe import expert_capacity, expert_counts, in_rows_dtype, weighted_expert_ffn_backward

# ---------------------------------------------------------------------------- source side


@torch.library.custom_op("commfx::expert_slots", mutates_args=())
def expert_slots(
    indices: torch.Tensor, previous: Optional[torch.Tensor], op_id: str, num_experts: int, ranks: int
) -> torch.Tensor:
    """The slot of each chosen expert under the runtime's current placement for `op_id`:
    slot = rank * (E / ranks) + local id. Placement is runtime state (it changes when the
    runtime re-places experts), so the graph stays the same on every rank and every step.
    Also records the routing statistics the placement solver reads (load, co-selection and,
    given the previous MoE layer's choices for the same tokens, transitions)."""
    placement = current_placements().get(op_id, num_experts, ranks)
    placement.record(indices, previous)
    return placement.slot_of.to(indices.device)[indices]


@expert_slots.register_fake
def _(indices, previous, op_id, num_experts, ranks):
    return torch.empty_like(indices)


@torch.library.custom_op("commfx::rank_dispatch", mutates_args=())
def rank_dispatch(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, ranks: int, local_experts: int, capacity_factor: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows for each destination rank, each token at most once per rank.

    `indices` are slots: slots [r*L, (r+1)*L) live on rank r (L = local_experts). Returns
    (rows [U, H], meta [U, 2k] (routing weights, then local expert ids as the weights'
    dtype, -1 where the expert is elsewhere or the assignment was dropped; weights there
    are 0), row_token [U], send [P]) with rows ordered by destination rank, token order
    within one, and send[r] rows for r. capacity_factor > 0 drops exactly what
    `moe_dispatch` drops (per expert, past its capacity, in token order); a token whose
    assignments to a rank were all dropped is not sent there.
    """
    kept = capacity_kept(indices, ranks * local_experts, capacity_factor)
    row_token, row_rank = _rank_layout(indices, kept, ranks, local_experts)
    owner = indices[row_token] // local_experts  # [U, k]
    here = (owner == row_rank.unsqueeze(1)) & kept[row_token]
    local_ids = torch.where(here, indices[row_token] - row_rank.unsqueeze(1) * local_experts, -1)
    row_weights = weights[row_token] * here.to(weights.dtype)
    meta = torch.cat([row_weights, local_ids.to(weights.dtype)], dim=1)
    send = expert_counts(row_rank, ranks)
    return x[row_token], meta, row_token, send


def capacity_kept(indices: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """[N, k] bool: the assignments `moe_dispatch` keeps (all of them when dropless): per
    expert, the first `expert_capacity` assignments in token order."""
    if capacity_factor <= 0:
        return torch.ones_like(indices, dtype=torch.bool)
    n, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (position < expert_capacity(n, k, num_experts, capacity_factor)).view(n, k)


def _rank_layout(indices: torch.Tensor, kept: torch.Tensor, ranks: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_token [U], row_rank [U]): the unique (token, rank) pairs of kept assignments,
    rank-major, token order."""
    n = indices.shape[0]
    in_rank = torch.zeros((ranks, n), dtype=torch.bool, device=indices.device)
    tokens = torch.arange(n, device=indices.device).unsqueeze(1).expand_as(indices)
    in_rank[(indices // local_experts)[kept], tokens[kept]] = True
    row_rank, row_token = in_rank.nonzero(as_tuple=True)  # row-major: by rank, then token
    return row_token.clone(), row_rank  # nonzero's column is a view at an offset; the fake's has its own storage


@rank_dispatch.register_fake
def _(x, indices, weights, ranks, local_experts, capacity_factor=0.0):
    rows = torch.library.get_ctx().new_dynamic_size()
    k = indices.shape[1]
    return (
        x.new_empty((rows, x.shape[1])),
        weights.new_empty((rows, 2 * k)),
        indices.new_empty((rows,), dtype=torch.int64),
        indices.new_empty((ranks,), dtype=torch.int64),
    )


def _rank_dispatch_setup(ctx, inputs, output):
    x, indices = inputs[0], inputs[1]
    _, meta, row_token, _ = output
    ctx.save_for_backward(row_token, meta)
    ctx.num_tokens, ctx.k = x.shape[0], indices.shape[1]


def _rank_dispatch_backward(ctx, grad_rows, grad_meta, grad_row_token, grad_send):
    row_token, meta = ctx.saved_tensors
    grad_x, grad_weights = rank_dispatch_backward(grad_rows, grad_meta, row_token, meta, ctx.num_tokens)
    return grad_x, None, grad_weights, None, None, None


@torch.library.custom_op("commfx::rank_dispatch_backward", mutates_args=())
def rank_dispatch_backward(
    grad_rows: torch.Tensor, grad_meta: torch.Tensor, row_token: torch.Tensor, meta: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rank_dispatch for x (a token's rows summed) and its routing weights (each
    weight went, unmasked, to exactly one rank: the one holding its expert)."""
    k = meta.shape[1] // 2
    grad_x = grad_rows.new_zeros((num_tokens, grad_rows.shape[1])).index_add(0, row_token, grad_rows)
    here = (meta[:, k:] >= 0).to(grad_meta.dtype)
    grad_weights = grad_meta.new_zeros((num_tokens, k)).index_add(0, row_token, grad_meta[:, :k] * here)
    return grad_x, grad_weights  # out of place: this body is also the op's aten form (ops/decompositions.py)


@rank_dispatch_backward.register_fake
def _(grad_rows, grad_meta, row_token, meta, num_tokens):
    k = meta.shape[1] // 2
    return grad_rows.new_empty((num_tokens, grad_rows.shape[1])), grad_meta.new_empty((num_tokens, k))


rank_dispatch.register_autograd(_rank_dispatch_backward, setup_context=_rank_dispatch_setup)
register_autocast(torch.ops.commfx.rank_dispatch.default, (0,))  # the rows, not the routing weights


@torch.library.custom_op("commfx::scatter_add_tokens", mutates_args=())
def scatter_add_tokens(rows: torch.Tensor, row_token: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of rows[u] over u with row_token[u] == t (tokens with no row get 0).
    `num_tokens` is a tensor whose dim 0 is the token count (the tokens themselves)."""
    return rows.new_zeros((num_tokens.shape[0], rows.shape[1])).index_add(0, row_token, rows)  # out of place: also its aten form


@scatter_add_tokens.register_fake
def _(rows, row_token, num_tokens):
    return rows.new_empty((num_tokens.shape[0], rows.shape[1]))


def _scatter_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _scatter_backward(ctx, grad):
    (row_token,) = ctx.saved_tensors
    return grad.index_select(0, row_token), None, None


scatter_add_tokens.register_autograd(_scatter_backward, setup_context=_scatter_setup)


# ---------------------------------------------------------------------------- receiver side


def _meta_columns(meta_cols: int, meta_dtype: torch.dtype, rows_dtype: torch.dtype) -> int:
    """Columns of `rows_dtype` that hold `meta_cols` values of `meta_dtype` bit for bit."""
    size = torch.empty((), dtype=rows_dtype).element_size()
    return -(-meta_cols * torch.empty((), dtype=meta_dtype).element_size() // size)


def _as_columns(meta: torch.Tensor, rows_dtype: torch.dtype) -> torch.Tensor:
    """meta [U, m] -> [U, c] of rows_dtype: its bytes, zero-padded to whole columns."""
    raw = meta.contiguous().view(torch.uint8)
    columns = _meta_columns(meta.shape[1], meta.dtype, rows_dtype)
    pad = columns * torch.empty((), dtype=rows_dtype).element_size() - raw.shape[1]
    if pad:
        raw = torch.cat([raw, raw.new_zeros((raw.shape[0], pad))], dim=1)
    return raw.view(rows_dtype)


def _from_columns(columns: torch.Tensor, meta_cols: int, meta_dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `_as_columns`."""
    raw = _dense(columns).view(torch.uint8)
    size = torch.empty((), dtype=meta_dtype).element_size()
    return _dense(raw[:, : meta_cols * size]).view(meta_dtype)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """A fresh row-major copy: viewing as another dtype needs its strides and offset to be
    multiples of the new element size, even when the tensor is empty (where `contiguous()`
    and `clone()` keep a slice's strides)."""
    return x.new_empty(x.shape).copy_(x)


@torch.library.custom_op("commfx::attach_meta", mutates_args=())
def attach_meta(rows: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """rows [U, H] and their routing metadata [U, 2k] as one [U, H + c] tensor of rows' dtype,
    the metadata's bytes carried as extra columns (bit for bit, whatever the two dtypes), so
    one all-to-all moves both: a second collective per chunk costs a latency each way."""
    return torch.cat([rows, _as_columns(meta, rows.dtype)], dim=1)


@attach_meta.register_fake
def _(rows, meta):
    return rows.new_empty((rows.shape[0], rows.shape[1] + _meta_columns(meta.shape[1], meta.dtype, rows.dtype)))


def _attach_setup(ctx, inputs, output):
    rows, meta = inputs
    ctx.hidden, ctx.meta_cols, ctx.meta_dtype = rows.shape[1], meta.shape[1], meta.dtype


def _attach_backward(ctx, grad):
    return grad[:, : ctx.hidden], _from_columns(grad[:, ctx.hidden :], ctx.meta_cols, ctx.meta_dtype)


attach_meta.register_autograd(_attach_backward, setup_context=_attach_setup)


@torch.library.custom_op("commfx::detach_meta", mutates_args=())
def detach_meta(payload: torch.Tensor, meta_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The receiver's side of `attach_meta`: payload [V, H + c] -> (rows [V, H], routing
    weights [V, k], local expert ids [V, k] int64). `meta_like` is this rank's own metadata
    (every rank's has the same dtype and width); only its dtype and width are read."""
    meta_cols = meta_like.shape[1]
    hidden = payload.shape[1] - _meta_columns(meta_cols, meta_like.dtype, payload.dtype)
    meta = _from_columns(payload[:, hidden:], meta_cols, meta_like.dtype)
    k = meta_cols // 2
    return payload[:, :hidden].clone(), meta[:, :k].clone(), meta[:, k:].round().to(torch.int64)


@detach_meta.register_fake
def _(payload, meta_like):
    k = meta_like.shape[1] // 2
    hidden = payload.shape[1] - _meta_columns(meta_like.shape[1], meta_like.dtype, payload.dtype)
    rows = payload.shape[0]
    return (
        payload.new_empty((rows, hidden)),
        meta_like.new_empty((rows, k)),
        meta_like.new_empty((rows, k), dtype=torch.int64),
    )


def _detach_setup(ctx, inputs, output):
    payload, meta_like = inputs
    ctx.rows_dtype, ctx.meta_dtype = payload.dtype, meta_like.dtype


def _detach_backward(ctx, grad_rows, grad_weights, grad_ids):
    """The weights' gradient goes back in the metadata's columns (the ids' get zeros)."""
    grad_meta = torch.cat([grad_weights, torch.zeros_like(grad_weights)], dim=1).to(ctx.meta_dtype)
    return torch.cat([grad_rows, _as_columns(grad_meta, ctx.rows_dtype)], dim=1), None


detach_meta.register_autograd(_detach_backward, setup_context=_detach_setup)


@torch.library.custom_op("commfx::masked_dispatch", mutates_args=())
def masked_dispatch(x: torch.Tensor, local_ids: torch.Tensor, local_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay received rows out by local expert: (rows [R, H], counts [L], slot [V*k]).

    Assignment (v, j) with local_ids[v, j] >= 0 becomes a row of expert local_ids[v, j]
    (expert-major, row order within one); slot maps each assignment to its row, -1 where the
    expert lives on another rank (so moe_combine adds nothing for it).
    """
    k = local_ids.shape[1]
    flat = local_ids.reshape(-1)
    valid = flat >= 0
    order = torch.argsort(torch.where(valid, flat, local_experts), stable=True)[: int(valid.sum())]
    slot = torch.full_like(flat, -1)
    slot[order] = torch.arange(order.numel(), device=flat.device)
    counts = torch.bincount(flat[valid], minlength=local_experts)
    return x[order // k], counts, slot


@masked_dispatch.register_fake
def _(x, local_ids, local_experts):
    rows = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty((rows, x.shape[1])),
        local_ids.new_empty((local_experts,), dtype=torch.int64),
        local_ids.new_empty((local_ids.numel(),), dtype=torch.int64),
    )


def _masked_setup(ctx, inputs, output):
    x, local_ids, _ = inputs
    ctx.save_for_backward(output[2])
    ctx.num_rows, ctx.k = x.shape[0], local_ids.shape[1]


def _masked_backward(ctx, grad_rows, grad_counts, grad_slot):
    (slot,) = ctx.saved_tensors
    return torch.ops.commfx.moe_scatter_rows(grad_rows, slot, ctx.num_rows, ctx.k), None, None


masked_dispatch.register_autograd(_masked_backward, setup_context=_masked_setup)


@torch.library.custom_op("commfx::packed_expert_ffn", mutates_args=())
def packed_expert_ffn(
    x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str
) -> torch.Tensor:
    """out[v] = sum_j weights[v, j] * expert_{local_ids[v, j]}(x[v]) over j with local_ids >= 0:
    masked_dispatch -> expert_ffn -> moe_combine as one computation, with no laid-out copy
    of the rows and no per-assignment output in memory (the fused kernel on CUDA)."""
    row, weight, counts = _assignments(local_ids, weights, gate_up.shape[0])
    gate_up, down = in_rows_dtype(x, gate_up, down)
    return packed_experts(x, row, weight.to(x.dtype), counts, gate_up, down, activation)


def _assignments(local_ids: torch.Tensor, weights: torch.Tensor, local_experts: int):
    """(row [A], weight [A], counts [L]): the valid assignments grouped by local expert (row
    order within one), the layout masked_dispatch makes."""
    order, counts = _assignment_order(local_ids, local_experts)
    return order // local_ids.shape[1], weights.reshape(-1)[order], counts


def _assignment_order(local_ids: torch.Tensor, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [A], counts [L]): flat indices v * k + j of the valid assignments, grouped by
    local expert (row order within one), and each expert's count."""
    flat = local_ids.reshape(-1)
    valid = flat >= 0
    order = torch.argsort(torch.where(valid, flat, local_experts), stable=True)[: int(valid.sum())]
    return order, torch.bincount(flat[valid], minlength=local_experts)


@packed_expert_ffn.register_fake
def _(x, local_ids, weights, gate_up, down, activation):
    return torch.empty_like(x)


def _packed_ffn_setup(ctx, inputs, output):
    x, local_ids, weights, gate_up, down, activation = inputs
    ctx.save_for_backward(x, local_ids, weights, gate_up, down)
    ctx.activation = activation


def _packed_ffn_backward(ctx, grad_out):
    x, local_ids, weights, gate_up, down = ctx.saved_tensors
    grad_x, grad_weights, grad_gate_up, grad_down = packed_expert_ffn_backward(grad_out, x, local_ids, weights, gate_up, down, ctx.activation)
    return grad_x, None, grad_weights, grad_gate_up, grad_down, None


@torch.library.custom_op("commfx::packed_expert_ffn_backward", mutates_args=())
def packed_expert_ffn_backward(
    grad_out: torch.Tensor, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of packed_expert_ffn for x, the routing weights and both expert weights, on
    the rows laid out by expert. Only the hidden layer is recomputed: the routing weights'
    gradient comes from the product with `down` the experts' backward computes anyway
    (`weighted_expert_ffn_backward`), not from recomputed expert outputs."""
    order, counts = _assignment_order(local_ids, gate_up.shape[0])
    row = order // local_ids.shape[1]
    laid = x[row]
    masters = gate_up, down
    gate_up, down = in_rows_dtype(x, gate_up, down)
    hidden = grouped_mm(laid, gate_up, counts)
    grad_laid, grad_gate_up, grad_down, grad_laid_weights = weighted_expert_ffn_backward(
        grad_out[row], weights.reshape(-1)[order], laid, hidden, counts, gate_up, down, activation)
    grad_x = torch.zeros_like(x).index_add_(0, row, grad_laid)
    grad_weights = torch.zeros_like(weights).view(-1).index_put_((order,), grad_laid_weights).view_as(weights)
    # remote experts' weights: zero gradient here
    return grad_x, grad_weights, grad_gate_up.to(masters[0].dtype), grad_down.to(masters[1].dtype)


@packed_expert_ffn_backward.register_fake
def _(grad_out, x, local_ids, weights, gate_up, down, activation):
    return torch.empty_like(x), torch.empty_like(weights), torch.empty_like(gate_up), torch.empty_like(down)


packed_expert_ffn.register_autograd(_packed_ffn_backward, setup_context=_packed_ffn_setup)
register_autocast(torch.ops.commfx.packed_expert_ffn.default, (0, 3, 4))  # rows and both weights, not the routing weights
