"""The per-rank module `commfx.distribute` returns.

It owns the rewritten graph with only this rank's expert shards (memory is really
sharded), runs it through the graph executor, and synchronises gradients during backward.
Its state_dict holds the local parameters under the original names (prefixed `module.`,
as with DDP) plus the expert placement, which loading checks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..plan import Plan
from ..program import Program
from .comm import CommScheduler, install_default
from .executor import GraphExecutor
from .grad_sync import GradientSync


class DistributedModule(torch.nn.Module):
    def __init__(self, program: Program, plan: Plan, scheduler: CommScheduler, placement: dict[str, list[int]]):
        super().__init__()
        self.module = program.gm
        self.program = program
        self.plan = plan
        self.scheduler = scheduler
        self.placement = placement  # sharded parameter -> [start, stop) of the full dim 0 held here
        install_default(scheduler)
        shards = program.annotations.get("shards", {})
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        group_of = {n: (shards[n]["replicated_over"] if n in shards else "world") for n, _ in named}
        scale = 1.0 / plan.topology.world_size if plan.grad_reduction == "mean" else 1.0
        self.grad_sync = GradientSync(named, group_of, scheduler, scale=scale)

    def forward(self, *inputs: torch.Tensor) -> Any:
        flat = GraphExecutor(self.module, self.scheduler).run(*inputs)
        return pytree.tree_unflatten(list(flat), self.program.out_spec)

    @property
    def comm_stats(self):
        return self.scheduler.stats

    def get_extra_state(self) -> dict:
        return {"placement": self.placement, "world_size": self.plan.topology.world_size}

    def set_extra_state(self, state: dict) -> None:
        if state.get("placement") != self.placement:
            raise ValueError(
                "this checkpoint holds a different expert placement "
                f"({state.get('placement')}) than this rank ({self.placement}); load it on the rank "
                "that saved it, with the same world size and ep"
            )


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
