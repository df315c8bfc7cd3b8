"""Materialise one rank's parameter shards in a rewritten graph module.

Passes record which parameters they shard (`program.annotations["shards"]`: dim, parts and
the group they are replicated over); this cuts this rank's slice out of each, so memory is
really sharded before the runtime ever sees the module.
"""

from __future__ import annotations

import torch

from .program import Program


def shard_parameters(program: Program, ep_rank: int) -> dict[str, list[int]]:
    """Replace every sharded parameter in the graph module by this rank's slice of it."""
    placement = {}
    for target, spec in program.annotations.get("shards", {}).items():
        owner_path, _, leaf = target.rpartition(".")
        owner = program.gm.get_submodule(owner_path) if owner_path else program.gm
        full = getattr(owner, leaf)
        size = full.shape[spec["dim"]] // spec["parts"]
        start = ep_rank * size
        local = full.detach().narrow(spec["dim"], start, size).clone()
        setattr(owner, leaf, torch.nn.Parameter(local, requires_grad=full.requires_grad))
        placement[target] = [start, start + size]
    return placement
