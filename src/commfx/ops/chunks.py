"""Token chunks of an expert-grouped row buffer (the partition_a2a pass splits MoE regions with these).

Rows grouped by expert (counts[e] rows for expert e, experts in order) are cut into
`parts` chunks: chunk j holds, for every expert, the rows at positions
[floor(c*j/parts), floor(c*(j+1)/parts)) of that expert's c rows. Every chunk is therefore
still grouped by expert (and by destination rank), so it can be sent with its own uneven
all-to-all; a rank that has few rows for an expert simply sends empty pieces. The receiver
derives its chunk counts from the counts it already received (`chunk_counts` of them), so
no extra count exchange is needed. Splitting then merging is the identity.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("commfx::chunk_counts", mutates_args=())
def chunk_counts(counts: torch.Tensor, parts: int) -> torch.Tensor:
    """counts [...] -> [parts, ...]: rows of each chunk (they sum to counts over dim 0)."""
    j = torch.arange(parts + 1, device=counts.device).view(-1, *([1] * counts.dim()))
    bounds = torch.div(counts.unsqueeze(0) * j, parts, rounding_mode="floor")
    return (bounds[1:] - bounds[:-1]).contiguous()


@chunk_counts.register_fake
def _(counts, parts):
    return counts.new_empty((parts, *counts.shape))


def _chunk_order(counts: torch.Tensor, parts: int) -> tuple[torch.Tensor, list[int]]:
    """A permutation listing rows chunk by chunk (expert order kept inside), and chunk sizes."""
    counts = counts.reshape(-1)
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(expert_of_row.numel(), device=counts.device) - starts[expert_of_row]
    # chunk of position p among c rows: the largest j with floor(c*j/parts) <= p.
    chunk_of_row = torch.div(parts * (position + 1) - 1, counts[expert_of_row], rounding_mode="floor")
    order = torch.argsort(chunk_of_row, stable=True)
    sizes = torch.bincount(chunk_of_row, minlength=parts).tolist()
    return order, sizes


@torch.library.custom_op("commfx::split_chunks", mutates_args=())
def split_chunks(rows: torch.Tensor, counts: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Expert-grouped rows [R, ...] -> `parts` chunks, each expert-grouped (see module doc)."""
    order, sizes = _chunk_order(counts, parts)
    return [rows[index] for index in order.split(sizes)]


@split_chunks.register_fake
def _(rows, counts, parts):
    ctx = torch.library.get_ctx()
    return [rows.new_empty((ctx.new_dynamic_size(), *rows.shape[1:])) for _ in range(parts)]


@torch.library.custom_op("commfx::merge_chunks", mutates_args=())
def merge_chunks(chunks: list[torch.Tensor], counts: torch.Tensor, parts: int) -> torch.Tensor:
    """The inverse of split_chunks."""
    order, _ = _chunk_order(counts, parts)
    stacked = torch.cat(chunks)
    out = stacked.new_empty(stacked.shape)
    out[order] = stacked
    return out


@merge_chunks.register_fake
def _(chunks, counts, parts):
    rows = sum(c.shape[0] for c in chunks)
    return chunks[0].new_empty((rows, *chunks[0].shape[1:]))


def _save_counts(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.parts = inputs[2]


split_chunks.register_autograd(
    lambda ctx, grads: (merge_chunks(list(grads), *ctx.saved_tensors, ctx.parts), None, None), setup_context=_save_counts
)
merge_chunks.register_autograd(
    lambda ctx, grad: (split_chunks(grad, *ctx.saved_tensors, ctx.parts), None, None), setup_context=_save_counts
)
