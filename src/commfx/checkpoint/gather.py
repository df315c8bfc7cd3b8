"""The whole model on one rank: every tensor at its full shape, from every rank's chunks.

For export (transformers' `save_pretrained`) and for comparing runs; it holds the full
model in memory, which a checkpoint never needs to."""

from __future__ import annotations

import torch

from .state import model_state, optimizer_values


def gather_full(dm, optimizer: torch.optim.Optimizer | None = None, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
    """name -> full tensor (parameters and buffers; with `optimizer`, also
    `optimizer/<name>/<key>` for its tensor state), from what each rank would save.
    Collective; the result is on `to_rank` (every rank with None), an empty dict elsewhere."""
    if hasattr(dm, "synchronize"):
        dm.synchronize()
    values = {name.removeprefix("model/"): value for name, value in model_state(dm).items()}
    if optimizer is not None:
        values.update(optimizer_values(dm, optimizer))
    mine = {}
    for name, value in values.items():
        if hasattr(value, "pieces"):
            mine[name] = (tuple(value.size()), [(offsets, piece.clone()) for offsets, piece in value.pieces])
        elif isinstance(value, torch.Tensor):
            mine[name] = (None, value.detach().clone())
    everyone = dm.scheduler.all_gather_object(mine)
    if to_rank is not None and dm.scheduler.rank != to_rank:
        return {}
    full = {}
    for name in dict.fromkeys(n for rank_state in everyone for n in rank_state):  # pipeline stages hold different tensors
        value = assemble([rank_state[name] for rank_state in everyone if name in rank_state])
        if value is not None:
            full[name] = value
    return full


def assemble(held: list[tuple]) -> torch.Tensor | None:
    """One tensor from what several ranks hold of it: each (size, [(offsets, piece), ...]),
    every piece written at its offsets into zeros of `size`; or (None, tensor), a whole
    replica (the first is taken). None when the ranks hold no piece of it."""
    size, first = held[0]
    if size is None:
        return first
    pieces = [piece for _, chunks in held for piece in chunks]
    if not pieces:
        return None
    out = pieces[0][1].new_zeros(size)
    for offsets, piece in pieces:
        out[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))] = piece
    return out
