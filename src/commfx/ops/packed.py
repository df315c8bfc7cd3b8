"""Canonical ops for once-per-rank dispatch (Lina's expert packing; DeepEP's dispatch layout).

Plain expert parallelism sends one row per (token, expert) assignment: a top-2 token whose
two experts live on the same rank crosses the wire twice each way. Here a token goes to each
destination rank at most once, carrying its routing weights and the local ids of the experts
it needs there; the receiver fans it out to those experts and sums their weighted outputs,
so one row comes back. Dispatch and combine rows are the unique (token, destination rank)
pairs: the minimum for a placement.

    rank_dispatch      source: token rows per destination rank, with weights and local ids
    masked_dispatch    receiver: rows laid out by local expert (assignments with id -1 skipped)
    moe_combine        receiver: weighted sum per received row (slot -1 adds nothing)
    scatter_add_tokens source: sum the rows that came back into their tokens
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------- source side


@torch.library.custom_op("commfx::rank_dispatch", mutates_args=())
def rank_dispatch(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, ranks: int, local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows for each destination rank, each token at most once per rank.

    Experts [r*L, (r+1)*L) live on rank r (L = local_experts). Returns
    (rows [U, H], meta [U, 2k] (routing weights, then local expert ids as the weights'
    dtype, -1 where the expert is elsewhere; weights there are 0), row_token [U], send [P])
    with rows ordered by destination rank, token order within one, and send[r] rows for r.
    """
    row_token, row_rank = _rank_layout(indices, ranks, local_experts)
    owner = indices[row_token] // local_experts  # [U, k]
    here = owner == row_rank.unsqueeze(1)
    local_ids = torch.where(here, indices[row_token] - row_rank.unsqueeze(1) * local_experts, -1)
    row_weights = weights[row_token] * here.to(weights.dtype)
    meta = torch.cat([row_weights, local_ids.to(weights.dtype)], dim=1)
    send = torch.bincount(row_rank, minlength=ranks)
    return x[row_token], meta, row_token, send


def _rank_layout(indices: torch.Tensor, ranks: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_token [U], row_rank [U]): the unique (token, rank) pairs, rank-major, token order."""
    n = indices.shape[0]
    in_rank = torch.zeros((ranks, n), dtype=torch.bool, device=indices.device)
    in_rank[indices.t() // local_experts, torch.arange(n, device=indices.device)] = True
    row_rank, row_token = in_rank.nonzero(as_tuple=True)  # row-major: by rank, then token
    return row_token, row_rank


@rank_dispatch.register_fake
def _(x, indices, weights, ranks, local_experts):
    rows = torch.library.get_ctx().new_dynamic_size()
    k = indices.shape[1]
    return (
        x.new_empty((rows, x.shape[1])),
        weights.new_empty((rows, 2 * k)),
        indices.new_empty((rows,), dtype=torch.int64),
        indices.new_empty((ranks,), dtype=torch.int64),
    )


def _rank_dispatch_setup(ctx, inputs, output):
    x, indices, weights, _, _ = inputs
    _, meta, row_token, _ = output
    ctx.save_for_backward(row_token, meta)
    ctx.num_tokens, ctx.k = x.shape[0], indices.shape[1]


def _rank_dispatch_backward(ctx, grad_rows, grad_meta, grad_row_token, grad_send):
    row_token, meta = ctx.saved_tensors
    grad_x, grad_weights = rank_dispatch_backward(grad_rows, grad_meta, row_token, meta, ctx.num_tokens)
    return grad_x, None, grad_weights, None, None


@torch.library.custom_op("commfx::rank_dispatch_backward", mutates_args=())
def rank_dispatch_backward(
    grad_rows: torch.Tensor, grad_meta: torch.Tensor, row_token: torch.Tensor, meta: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rank_dispatch for x (a token's rows summed) and its routing weights (each
    weight went, unmasked, to exactly one rank: the one holding its expert)."""
    k = meta.shape[1] // 2
    grad_x = grad_rows.new_zeros((num_tokens, grad_rows.shape[1])).index_add_(0, row_token, grad_rows)
    here = (meta[:, k:] >= 0).to(grad_meta.dtype)
    grad_weights = grad_meta.new_zeros((num_tokens, k)).index_add_(0, row_token, grad_meta[:, :k] * here)
    return grad_x, grad_weights


@rank_dispatch_backward.register_fake
def _(grad_rows, grad_meta, row_token, meta, num_tokens):
    k = meta.shape[1] // 2
    return grad_rows.new_empty((num_tokens, grad_rows.shape[1])), grad_meta.new_empty((num_tokens, k))


rank_dispatch.register_autograd(_rank_dispatch_backward, setup_context=_rank_dispatch_setup)


@torch.library.custom_op("commfx::scatter_add_tokens", mutates_args=())
def scatter_add_tokens(rows: torch.Tensor, row_token: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of rows[u] over u with row_token[u] == t (tokens with no row get 0).
    `num_tokens` is a tensor whose dim 0 is the token count (the tokens themselves)."""
    return rows.new_zeros((num_tokens.shape[0], rows.shape[1])).index_add_(0, row_token, rows)


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


@torch.library.custom_op("commfx::split_meta", mutates_args=())
def split_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """meta [V, 2k] -> (routing weights [V, k], local expert ids [V, k] int64)."""
    k = meta.shape[1] // 2
    return meta[:, :k].clone(), meta[:, k:].round().to(torch.int64)


@split_meta.register_fake
def _(meta):
    k = meta.shape[1] // 2
    return meta.new_empty((meta.shape[0], k)), meta.new_empty((meta.shape[0], k), dtype=torch.int64)


def _split_meta_backward(ctx, grad_weights, grad_ids):
    return torch.cat([grad_weights, torch.zeros_like(grad_weights)], dim=1)


split_meta.register_autograd(_split_meta_backward)


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
