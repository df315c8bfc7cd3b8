"""Materialise one rank's parameter shards in a rewritten graph module.

Passes record which parameters they shard (`program.runtime.shards`: dim, parts, the
group whose rank picks the part, and the group they are replicated over); this cuts this
rank's slice out of each, so memory is really sharded before the runtime ever sees the
module.

A shard is a block of consecutive indices along `dim` (expert_parallel), or, when the spec
has a `layout` (tensor_parallel), a block of *units* of a dim numbered row-major as
(outer, units, inner): the fused q/k/v weight of 4 heads of 8 is (3, 4, 8), and rank r of 2
holds heads 2r and 2r+1 of each of q, k and v.
"""

from __future__ import annotations

import torch

from ..ops.tp import shard_index
from .program import Program

__all__ = ["assemble", "shard_index", "shard_parameters"]


def shard_parameters(program: Program, ranks: dict[str, int] | int) -> dict[str, object]:
    """Replace every sharded parameter in the graph module by this rank's slice of it.

    `ranks`: this rank's index in each group that shards parameters ({"ep": 1, "tp": 0}); an
    int is the ep index (every group the same index: the single-process `lower`)."""
    placement = {}
    for target, spec in program.runtime.shards.items():
        owner_path, _, leaf = target.rpartition(".")
        owner = program.gm.get_submodule(owner_path) if owner_path else program.gm
        full = getattr(owner, leaf)
        part = ranks if isinstance(ranks, int) else ranks.get(spec["group"], 0)
        if "layout" in spec:
            index = shard_index(spec["layout"], part, spec["parts"])
            placement[target] = {"dim": spec["dim"], "layout": list(spec["layout"]), "part": part, "parts": spec["parts"]}
        else:
            size = full.shape[spec["dim"]] // spec["parts"]
            start = part * size
            placement[target] = [start, start + size]
        if spec["parts"] == 1:
            continue  # one part: the parameter itself, shared with the model, not a second copy
        local = full.detach().index_select(spec["dim"], index) if "layout" in spec else full.detach().narrow(spec["dim"], start, size)
        setattr(owner, leaf, torch.nn.Parameter(local.clone(), requires_grad=full.requires_grad))
    return placement


def assemble(pieces: list[torch.Tensor], placements: list[object]) -> torch.Tensor:
    """The full tensor from every part's slice and placement (the inverse of sharding)."""
    first = placements[0]
    if isinstance(first, dict):
        dim = first["dim"]
        shape = list(pieces[0].shape)
        shape[dim] = pieces[0].shape[dim] * first["parts"]
        full = pieces[0].new_zeros(shape)
        for piece, where in zip(pieces, placements):
            full.index_copy_(dim, shard_index(where["layout"], where["part"], where["parts"]), piece)
        return full
    return torch.cat(pieces)
