"""Canonical embedding ops and the pieces of sparse embedding communication (EmbRace).

After `lift`, every table lookup is `commfx.embedding(weight, ids, padding_idx)` (padding
-1: none), whatever the model wrote (`nn.Embedding`, `F.embedding`, HF `embed_tokens`).
Its gradient is a dense [V, H] table that the gradient sync all-reduces (strategy "dense").
`split_embedding_comm` swaps in one of two sparse spellings:

- replicated, sparse exchange: `sparse_grad_embedding` looks up like `embedding`; its
  backward (`exchange_row_grads`) coalesces this rank's row gradients into one
  (id, row) pair per touched id, sends the pairs to every rank, and each rank adds all
  ranks' pairs, in rank order, into the same dense gradient; already reduced, so the
  gradient sync leaves it alone.
- row-sharded: rank r holds rows [r V/P, (r+1) V/P). `embedding_route` finds the unique
  ids (sorted, so grouped by owner) and how many go to each owner; `embedding_counts` and
  `embedding_all_to_all` send ids to owners and rows back; the owner looks its rows up
  with `local_rows` + `embedding`. The autograd of this chain is the backward exchange:
  the lookup of rows by `inverse` coalesces token gradients into one row per unique id,
  the reverse all-to-all carries them to the owners, and the owner's `embedding` backward
  adds them into its shard's gradient.
- schedule=2d: `row_embedding` (replicated) and `row_sharded_embedding` (row-sharded, the
  owner's lookup and the rows' way back in one op) settle the rows they read before reading
  them; their backward, `post_row_grads`, hands the coalesced row gradients to the runtime's row
  schedule (`runtime/row_schedule.py`), which exchanges them into the next step.

Group names and sizes are literals (the same on every rank); a rank's own offset is read
at run time from the scheduler, so graphs stay rank-independent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.embedding import accumulate_rows, coalesce_rows
from .comm import all_to_all_setup
from ..runtime.comm import current_scheduler
from ..runtime.row_schedule import RowSchedule, row_schedule_of

KIND = "embedding_all_to_all"  # what the scheduler counts embedding bytes under


def _padding(padding_idx: int) -> int | None:
    return None if padding_idx < 0 else padding_idx


def _dense_grad(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: int) -> torch.Tensor:
    rows, flat = grad.reshape(-1, grad.shape[-1]), ids.reshape(-1)
    if padding_idx >= 0:
        keep = flat != padding_idx
        rows, flat = rows[keep], flat[keep]
    return accumulate_rows(grad.new_zeros((num_rows, grad.shape[-1])), flat, rows)


# ---------------------------------------------------------------------- canonical lookup


@torch.library.custom_op("commfx::embedding", mutates_args=())
def embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1) -> torch.Tensor:
    """weight[ids]: [*ids.shape, H]. The gradient of padding_idx's row is zero (as torch's)."""
    return F.embedding(ids, weight, _padding(padding_idx))


@embedding.register_fake
def _(weight, ids, padding_idx=-1):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("commfx::embedding_dense_grad", mutates_args=())
def embedding_dense_grad(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: int) -> torch.Tensor:
    """The table gradient: grad's rows added into a zero [num_rows, H] table, in token order."""
    return _dense_grad(grad, ids, num_rows, padding_idx)


@embedding_dense_grad.register_fake
def _(grad, ids, num_rows, padding_idx):
    return grad.new_empty((num_rows, grad.shape[-1]))


def _embedding_setup(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_rows, ctx.padding_idx = weight.shape[0], padding_idx


def _embedding_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return embedding_dense_grad(grad.contiguous(), ids, ctx.num_rows, ctx.padding_idx), None, None


embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# ------------------------------------------------------- replicated table, sparse exchange


@torch.library.custom_op("commfx::sparse_grad_embedding", mutates_args=())
def sparse_grad_embedding(
    weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, group: str, parts: int, scale: float, priority: str
) -> torch.Tensor:
    """weight[ids], whose gradient is exchanged sparsely over `group` (see exchange_row_grads)."""
    return F.embedding(ids, weight, _padding(padding_idx))


@sparse_grad_embedding.register_fake
def _(weight, ids, padding_idx, group, parts, scale, priority):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("commfx::exchange_row_grads", mutates_args=())
def exchange_row_grads(
    grad: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: int, group: str, parts: int, scale: float, priority: str
) -> torch.Tensor:
    """The reduced table gradient from (id, row) pairs: coalesce this rank's rows, send the
    pairs to every rank of `group` (uneven: each rank touches its own number of ids), and
    add every rank's pairs in rank order into zeros, times `scale`. Every rank computes the
    same bits, like an all-reduce, but only touched rows travel."""
    scheduler = current_scheduler()
    unique, summed = coalesce_rows(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), padding_idx)
    ones = [1] * parts
    mine = torch.full((parts, 1), unique.shape[0], dtype=torch.int64)
    counts = scheduler.all_to_all(mine, ones, ones, group, priority, "embedding pair counts", KIND).reshape(-1).tolist()
    send = [unique.shape[0]] * parts
    all_ids = scheduler.all_to_all(unique.repeat(parts), send, counts, group, priority, "embedding row ids", KIND)
    all_rows = scheduler.all_to_all(summed.repeat(parts, 1), send, counts, group, priority, "embedding row grads", KIND)
    table = accumulate_rows(grad.new_zeros((num_rows, grad.shape[-1])), all_ids, all_rows)
    return table.mul_(scale) if scale != 1.0 else table


@exchange_row_grads.register_fake
def _(grad, ids, num_rows, padding_idx, group, parts, scale, priority):
    return grad.new_empty((num_rows, grad.shape[-1]))


def _sparse_setup(ctx, inputs, output):
    weight, ids, padding_idx, group, parts, scale, priority = inputs
    ctx.save_for_backward(ids)
    ctx.args = (weight.shape[0], padding_idx, group, parts, scale, priority)


def _sparse_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return exchange_row_grads(grad.contiguous(), ids, *ctx.args), None, None, None, None, None, None


sparse_grad_embedding.register_autograd(_sparse_backward, setup_context=_sparse_setup)


# ----------------------------------------------------------------------- row-sharded table


@torch.library.custom_op("commfx::embedding_route", mutates_args=())
def embedding_route(ids: torch.Tensor, num_rows: int, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique ids, inverse, ids per owner [parts]): unique[inverse] == ids (inverse has ids'
    shape). Unique ids are sorted, so they are grouped by owner (block ownership) in rank order."""
    unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
    owners = torch.div(unique, num_rows // parts, rounding_mode="floor")
    return unique, inverse.reshape(ids.shape), torch.bincount(owners, minlength=parts)


@embedding_route.register_fake
def _(ids, num_rows, parts):
    unique = ids.new_empty((torch.library.get_ctx().new_dynamic_size(),))
    return unique, torch.empty_like(ids), ids.new_empty((parts,))


@torch.library.custom_op("commfx::embedding_counts", mutates_args=())
def embedding_counts(send_counts: torch.Tensor, group: str, priority: str) -> torch.Tensor:
    """send_counts [P] (ids this rank asks each owner for) -> [P]: ids each rank asks me for."""
    ones = [1] * send_counts.shape[0]
    received = current_scheduler().all_to_all(send_counts.reshape(-1, 1).contiguous(), ones, ones, group, priority, "embedding id counts", KIND)
    return received.reshape(-1)


@embedding_counts.register_fake
def _(send_counts, group, priority):
    return send_counts.new_empty(send_counts.shape)


@torch.library.custom_op("commfx::embedding_all_to_all", mutates_args=())
def embedding_all_to_all(
    x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, group: str, priority: str, tag: str
) -> torch.Tensor:
    """Uneven all-to-all of embedding ids or rows (counted as embedding bytes)."""
    return current_scheduler().all_to_all(x.contiguous(), send_counts.tolist(), recv_counts.tolist(), group, priority, tag, KIND)


@embedding_all_to_all.register_fake
def _(x, send_counts, recv_counts, group, priority, tag):
    return x.new_empty((torch.library.get_ctx().new_dynamic_size(), *x.shape[1:]))


def _a2a_backward(ctx, grad):
    send_counts, recv_counts = ctx.saved_tensors
    back = embedding_all_to_all(grad.contiguous(), recv_counts, send_counts, ctx.group, ctx.priority, f"{ctx.tag} (bw)")
    return back, None, None, None, None, None


embedding_all_to_all.register_autograd(_a2a_backward, setup_context=all_to_all_setup)  # the same arguments as commfx.all_to_all


@torch.library.custom_op("commfx::local_rows", mutates_args=())
def local_rows(ids: torch.Tensor, rows_per_part: int, group: str) -> torch.Tensor:
    """Global row ids this rank owns -> row numbers in its shard (offset read at run time).

    In compute-only mode (`commfx bench`: every collective a local copy) no ids really
    reached their owner, so the rank's own ids are folded into its shard: a lookup of the
    same size, whatever rows it reads."""
    scheduler = current_scheduler()
    if scheduler.local_only:
        return ids.remainder(rows_per_part)
    return ids - scheduler.group(group).rank * rows_per_part


@local_rows.register_fake
def _(ids, rows_per_part, group):
    return torch.empty_like(ids)


@torch.library.custom_op("commfx::mask_padding_grad", mutates_args=())
def mask_padding_grad(x: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """Identity; its gradient is zero where ids == padding_idx (torch's padding_idx rule)."""
    return x.clone()


@mask_padding_grad.register_fake
def _(x, ids, padding_idx):
    return torch.empty_like(x)


def _mask_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.padding_idx = inputs[2]


def _mask_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return grad * (ids != ctx.padding_idx).unsqueeze(-1).to(grad.dtype), None, None


mask_padding_grad.register_autograd(_mask_backward, setup_context=_mask_setup)


# ------------------------------------------- schedule=2d: row gradients into the next step
# The lookups settle the rows they read first (their gradients from the last backward, and
# the optimizer step they missed: runtime/row_schedule.py); their backward posts the row gradients.


def _settle(table: str, reads: torch.Tensor) -> None:
    rows = row_schedule_of(current_scheduler())
    if rows is not None and rows.pending:
        rows.before_lookup(table, reads)


@torch.library.custom_op("commfx::row_embedding", mutates_args=())
def row_embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, table: str, group: str, parts: int, scale: float) -> torch.Tensor:
    """weight[ids] of a replicated table after settling those rows; backward: `post_row_grads`."""
    _settle(table, ids)
    return F.embedding(ids, weight, _padding(padding_idx))


@row_embedding.register_fake
def _(weight, ids, padding_idx, table, group, parts, scale):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("commfx::row_sharded_embedding", mutates_args=())
def row_sharded_embedding(
    weight: torch.Tensor, local: torch.Tensor, inverse: torch.Tensor, ids: torch.Tensor, send_counts: torch.Tensor,
    recv_counts: torch.Tensor, padding_idx: int, table: str, group: str, parts: int, scale: float,
) -> torch.Tensor:
    """A row-sharded table's lookup after settling the rows of this rank's shard it was asked
    for (`local`): the owner looks them up, sends them back, and they are read by token
    (`inverse`). Backward: `post_row_grads` (the token gradients of `ids`, coalesced, to their owners)."""
    _settle(table, local)
    served = F.embedding(local, weight)
    back = current_scheduler().all_to_all(served.contiguous(), recv_counts.tolist(), send_counts.tolist(), group, "a2a", f"{table} rows", KIND)
    return F.embedding(inverse, back)


@row_sharded_embedding.register_fake
def _(weight, local, inverse, ids, send_counts, recv_counts, padding_idx, table, group, parts, scale):
    return weight.new_empty((*inverse.shape, weight.shape[1]))


@torch.library.custom_op("commfx::post_row_grads", mutates_args=())
def post_row_grads(
    grad: torch.Tensor, ids: torch.Tensor, local_rows: int, padding_idx: int, table: str, layout: str, group: str, parts: int, scale: float
) -> torch.Tensor:
    """The table's gradient from its token gradients: coalesced per id and exchanged (layout
    "sparse": to every rank; "shard": to each row's owner), times `scale`. Once the module
    has an optimizer the exchange runs into the next step and this returns zeros (the
    runtime steps the table's rows before they are next read)."""
    scheduler = current_scheduler()
    rows = row_schedule_of(scheduler)
    if rows is None:
        rows = RowSchedule(scheduler, {})
    return rows.post(table, grad, ids, local_rows, padding_idx, layout, group, scale)


@post_row_grads.register_fake
def _(grad, ids, local_rows, padding_idx, table, layout, group, parts, scale):
    return grad.new_empty((local_rows, grad.shape[-1]))


def _row_setup(ctx, inputs, output):
    weight, ids = inputs[0], inputs[1]
    ctx.save_for_backward(ids)
    ctx.args = (weight.shape[0], *inputs[2:4], "sparse", *inputs[4:])


def _row_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    local_rows, padding_idx, table, layout, group, parts, scale = ctx.args
    return post_row_grads(grad.contiguous(), ids, local_rows, padding_idx, table, layout, group, parts, scale), None, None, None, None, None, None


row_embedding.register_autograd(_row_backward, setup_context=_row_setup)


def _row_sharded_setup(ctx, inputs, output):
    weight, ids = inputs[0], inputs[3]
    ctx.save_for_backward(ids)
    ctx.args = (weight.shape[0], inputs[6], inputs[7], "shard", *inputs[8:])


def _row_sharded_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    local_rows, padding_idx, table, layout, group, parts, scale = ctx.args
    grad_weight = post_row_grads(grad.contiguous(), ids, local_rows, padding_idx, table, layout, group, parts, scale)
    return grad_weight, *([None] * 10)


row_sharded_embedding.register_autograd(_row_sharded_backward, setup_context=_row_sharded_setup)
