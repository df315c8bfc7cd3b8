"""The Python API: compile a model with a plan, or distribute it over the current world."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .capture import capture
from .passes import run_passes
from .plan import Plan, PlanError
from .program import Program
from .runtime.comm import CommScheduler, build_groups
from .runtime.module import DistributedModule, shard_parameters


def compile_program(
    model: torch.nn.Module, plan: Plan, example_inputs: tuple[torch.Tensor, ...], *, stop_after: str | None = None
) -> Program:
    """Validate the plan, capture the model and run the plan's passes (single process)."""
    plan.validate(model)
    program = capture(model, tuple(example_inputs))
    return run_passes(program, plan, stop_after=stop_after)


def distribute(model: torch.nn.Module, plan: Plan, example_inputs: tuple[torch.Tensor, ...]) -> DistributedModule:
    """Rewrite `model` by `plan` and return this rank's module (call on every rank).

    Needs an initialised default process group whose size is the plan's world size.
    `example_inputs` is this rank's batch (any batch size: the graph is batch-symbolic).
    """
    if not dist.is_initialized():
        raise PlanError(
            "commfx.distribute needs torch.distributed initialised on every rank "
            "(torch.distributed.init_process_group), or use `commfx run` / commfx.runtime.launcher.launch"
        )
    world = dist.get_world_size()
    if world != plan.topology.world_size:
        raise PlanError(
            f"the plan is for world size {plan.topology.world_size} but the process group has {world} ranks; "
            f"make them agree (--world-size {world})"
        )
    rank = dist.get_rank()
    program = compile_program(model, plan, example_inputs)
    groups = build_groups(plan.topology, rank)
    placement = shard_parameters(program, groups["ep"].rank)
    scheduler = CommScheduler(plan.topology, rank, groups)
    return DistributedModule(program, plan, scheduler, placement)
