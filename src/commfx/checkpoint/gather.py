"""The whole model on one rank: every tensor at its full shape, from every rank's chunks.

For export (transformers' `save_pretrained`) and for comparing runs; it holds the full
model in memory, which a checkpoint never needs to."""

from __future__ import annotations

import torch

from .state import layout_of, named_tensors, optimizer_state


def gather_full(dm, optimizer: torch.optim.Optimizer | None = None, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
    """name -> full tensor (parameters and buffers; with `optimizer`, also
    `optimizer/<name>/<key>` for its tensor state). Collective; the result is on `to_rank`
    (every rank with None), an empty dict elsewhere."""
    layout = layout_of(dm)
    mine = {}
    for name, tensor in named_tensors(dm).items():
        sharding = layout.get(name)
        mine[name] = (tensor.detach().clone(), None if sharding is None else (sharding.dim, sharding.indices, sharding.full))
    if optimizer is not None:
        for fqn, value in optimizer_state(dm, optimizer).items():
            if hasattr(value, "pieces"):
                name = fqn.split("/", 1)[1].rpartition("/")[0]
                sharding = layout[name]
                state = optimizer.state[dm.module.get_parameter(name)][fqn.rpartition("/")[2]]
                mine[fqn] = (state.detach().clone(), (sharding.dim, sharding.indices, sharding.full))
            elif isinstance(value, torch.Tensor):
                mine[fqn] = (value.detach().clone(), None)
    everyone = dm.scheduler.all_gather_object(mine)
    if to_rank is not None and dm.scheduler.rank != to_rank:
        return {}
    full = {}
    for name, (tensor, sharding) in everyone[0].items():
        if sharding is None:
            full[name] = tensor
            continue
        dim, _, size = sharding
        shape = list(tensor.shape)
        shape[dim] = size
        out = tensor.new_zeros(shape)
        for rank_state in everyone:
            piece, (_, indices, _) = rank_state[name]
            out.index_copy_(dim, torch.tensor(indices), piece)
        full[name] = out
    return full
