"""A vocabulary-parallel LM head with its cross-entropy loss (split_embedding_comm, head=shard).

An untied LM head is a [V, H] table too, but its gradient is dense (the softmax touches
every row), so data parallelism all-reduces all of it every step: at V = 50,000 that is
most of a small model's traffic. The head's gradient is dense, but what it is computed
from is small: the tokens' hidden states [T, H] and their labels. So each rank keeps a
block of V/P rows (model parallel inside data parallel, as EmbRace shards embedding
tables and Megatron shards the vocabulary):

- forward: every rank's hidden states and labels go to every rank of the group (an
  all-gather, as uneven all-to-alls: ranks hold different token counts); each rank
  computes the logits of every token over its rows, and sends per token its partial
  log-sum-exp and, where it owns the label, the label's logit; each token's loss is
  logsumexp over the parts minus the label's logit. A rank's loss is its own tokens'
  mean (or sum), exactly what F.cross_entropy gives on its own batch.
- backward: the loss gradients of all ranks are exchanged (one scalar each); each rank
  forms d logits = (softmax - onehot) x (its token's owner's loss gradient) over its rows,
  its shard's gradient is d logits^T x (already the sum over the group's tokens, like an
  expert's), and d logits x W goes back to each token's owner, which adds the parts.

Per rank and step that moves about (P-1) x T x (2 H + a few) numbers instead of
2 (P-1)/P x V x H. Lossless: the same function and gradients as the dense head (float64
tests). Only a head whose logits feed nothing but the loss can be sharded (else every
rank would need all of its tokens' logits back); `lift_heads` checks that.
"""

from __future__ import annotations

import torch

from ..runtime.comm import current_scheduler

KIND = "head_all_to_all"  # what the scheduler counts the head's bytes under
MEAN = "mean"  # reduction="sum" adds the tokens up instead


def _everyone(scheduler, x: torch.Tensor, counts: list[int], group: str, priority: str, tag: str) -> torch.Tensor:
    """Every rank's `x` (its own rows), concatenated in rank order (an uneven all-gather)."""
    parts = len(counts)
    return scheduler.all_to_all(x.repeat(parts, *([1] * (x.dim() - 1))).contiguous(), [x.shape[0]] * parts, counts, group, priority, tag, KIND)


def _own_slice(counts: list[int], index: int) -> slice:
    start = sum(counts[:index])
    return slice(start, start + counts[index])


def _rows_of(labels: torch.Tensor, offset: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(which labels fall in this rank's rows, their row numbers clamped into range)."""
    mine = (labels >= offset) & (labels < offset + rows)
    return mine, (labels - offset).clamp(0, rows - 1)


@torch.library.custom_op("commfx::vocab_parallel_loss", mutates_args=())
def vocab_parallel_loss(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str, group: str, parts: int, priority: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cross_entropy(x @ full_weight.T, labels) of this rank's tokens, with `weight` this
    rank's block of rows of the head. Returns (loss, and for the backward: every rank's
    tokens x_all, their labels, this rank's logits over its rows, each token's
    log-sum-exp, and the token count of each rank)."""
    scheduler = current_scheduler()
    handle = scheduler.group(group)
    mine = torch.full((parts, 1), x.shape[0], dtype=torch.int64)
    counts_t = scheduler.all_to_all(mine, [1] * parts, [1] * parts, group, priority, "head token counts", KIND).reshape(-1)
    counts = counts_t.tolist()
    x_all = _everyone(scheduler, x, counts, group, priority, "head hidden states")
    labels_all = _everyone(scheduler, labels, counts, group, priority, "head labels")
    logits = x_all @ weight.t()
    local_lse = torch.logsumexp(logits, dim=-1)
    owned, row = _rows_of(labels_all, handle.rank * weight.shape[0], weight.shape[0])
    target = torch.where(owned, logits.gather(1, row.unsqueeze(1)).squeeze(1), torch.zeros_like(local_lse))
    stats = torch.stack([local_lse, target], dim=1)
    every = scheduler.all_to_all(stats.repeat(parts, 1).contiguous(), [stats.shape[0]] * parts, [stats.shape[0]] * parts, group, priority, "head log-sum-exp", KIND)
    every = every.view(parts, -1, 2)
    lse = torch.logsumexp(every[..., 0], dim=0)
    valid = labels_all != ignore_index
    per_token = torch.where(valid, lse - every[..., 1].sum(0), torch.zeros_like(lse))
    own = _own_slice(counts, handle.rank)
    loss = per_token[own].sum()
    if reduction == MEAN:
        loss = loss / valid[own].sum()
    return loss, x_all, labels_all, logits, lse, counts_t


@vocab_parallel_loss.register_fake
def _(x, weight, labels, ignore_index, reduction, group, parts, priority):
    tokens = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(()),
        x.new_empty((tokens, x.shape[1])),
        labels.new_empty((tokens,)),
        x.new_empty((tokens, weight.shape[0])),
        x.new_empty((tokens,)),
        labels.new_empty((parts,), dtype=torch.int64),
    )


@torch.library.custom_op("commfx::vocab_parallel_loss_backward", mutates_args=())
def vocab_parallel_loss_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    x_all: torch.Tensor,
    weight: torch.Tensor,
    labels_all: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    counts: torch.Tensor,
    ignore_index: int,
    reduction: str,
    group: str,
    parts: int,
    priority: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of this rank's tokens' hidden states, of the logits over this rank's rows).
    The head's gradient (d logits^T x) is left to the graph: nothing on the wire waits for it,
    so the backward can run it after the work whose gradients are all-reduced."""
    scheduler = current_scheduler()
    handle = scheduler.group(group)
    sizes = counts.tolist()
    ones = [1] * parts
    grads = scheduler.all_to_all(grad.reshape(1, 1).repeat(parts, 1).contiguous(), ones, ones, group, priority, "head loss gradients", KIND)
    valid = labels_all != ignore_index
    owner = torch.repeat_interleave(torch.arange(parts), counts)
    scale = grads.reshape(-1)[owner]
    if reduction == MEAN:
        per_rank = torch.stack([valid[_own_slice(sizes, r)].sum() for r in range(parts)]).to(scale.dtype)
        scale = scale / per_rank[owner]
    scale = torch.where(valid, scale, torch.zeros_like(scale))
    d_logits = torch.exp(logits - lse.unsqueeze(1))
    owned, row = _rows_of(labels_all, handle.rank * weight.shape[0], weight.shape[0])
    d_logits.scatter_add_(1, row.unsqueeze(1), -owned.to(d_logits.dtype).unsqueeze(1))
    d_logits.mul_(scale.unsqueeze(1))
    partial = d_logits @ weight
    back = scheduler.all_to_all(partial.contiguous(), sizes, [x.shape[0]] * parts, group, priority, "head hidden-state gradients", KIND)
    return back.view(parts, x.shape[0], x.shape[1]).sum(0), d_logits


@vocab_parallel_loss_backward.register_fake
def _(grad, x, x_all, weight, labels_all, logits, lse, counts, ignore_index, reduction, group, parts, priority):
    return torch.empty_like(x), torch.empty_like(logits)


def _setup(ctx, inputs, output):
    x, weight, labels, ignore_index, reduction, group, parts, priority = inputs
    _, x_all, labels_all, logits, lse, counts = output
    ctx.save_for_backward(x, x_all, weight, labels_all, logits, lse, counts)
    ctx.args = (ignore_index, reduction, group, parts, priority)


def _backward(ctx, grad, *unused):
    grad_x, d_logits = vocab_parallel_loss_backward(grad, *ctx.saved_tensors, *ctx.args)
    x_all = ctx.saved_tensors[1]
    return grad_x, d_logits.t() @ x_all, None, None, None, None, None, None


vocab_parallel_loss.register_autograd(_backward, setup_context=_setup)
