"""The Python API: distribute a model over the current world (and, re-exported, compile it
with a plan in one process: `commfx.compile_program`)."""

from __future__ import annotations

import copy
import difflib

import torch
import torch.distributed as dist

from .compiler.capture import split_inputs, tokens_of
from .compiler.lower import compile_training
from .compiler.pipeline import compile_program
from .compiler.program import Program
from .compiler.sharding import shard_parameters
from .plan import Plan, PlanError
from .runtime.comm import CommScheduler, build_groups
from .runtime.executor import is_collective
from .runtime.module import DistributedModule
from .runtime.pipeline.module import PipelineModule
from .runtime.replicas import REPLICA_MODES, broadcast_replicas, check_replicas, named_state


def distribute(
    model: torch.nn.Module, plan: Plan, example_inputs, example_kwargs: dict | None = None, *, replicas: str = "check"
) -> DistributedModule:
    """Rewrite `model` by `plan` and return this rank's module (call on every rank).

    Needs an initialised default process group whose size is the plan's world size.
    `example_inputs` is this rank's batch (any batch size: the graph is batch-symbolic): a
    tuple of tensors, or a dict of keyword tensors; `example_kwargs` adds keyword tensors
    (`distribute(hf_model, plan, (ids,), {"labels": ids})`). The module is then called the
    same way, positionally or by keyword, and returns what the model returns (for an HF
    model, a `ModelOutput` with `logits`, and `loss` when labels are passed).

    `replicas`: every rank must start from the same model. "check" (default) compares a
    digest of every parameter and buffer across ranks and names those that differ;
    "broadcast" gives every rank rank 0's values first; "off" skips both.
    """
    if replicas not in REPLICA_MODES:
        raise PlanError(f"replicas={replicas!r} is not one of {', '.join(REPLICA_MODES)}")
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
    groups = build_groups(plan.topology, rank, timeout_s=plan.collective_timeout_s)
    scheduler = CommScheduler(plan.topology, rank, groups, timeout_s=plan.collective_timeout_s)
    if replicas == "broadcast":
        broadcast_replicas(scheduler, named_state(model))
    elif replicas == "check":
        check_replicas(scheduler, named_state(model))
    # Cost models must choose the same on every rank, however uneven the batches.
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    if _has_no_rows((*args, *kwargs.values())):
        # This rank's share of the batch is empty: capture on one stand-in row (the graph is
        # the same on every rank); at run time the module does the same (see DistributedModule).
        args, kwargs = tuple(stand_in_row(t) for t in args), {k: stand_in_row(t) for k, t in kwargs.items()}
    tokens = max(scheduler.all_gather_object(tokens_of((*args, *kwargs.values()))))
    program = compile_program(model, plan, args, kwargs, tokens_per_rank=tokens)
    _check_same_graph(scheduler, program)
    if "pipeline" in program.annotations:
        return _pipeline_module(program, plan, scheduler, groups["ep"].rank)
    placement = shard_parameters(program, {name: handle.rank for name, handle in groups.items() if "/" not in name})
    return DistributedModule(program, plan, scheduler, placement, compile_training)


def _pipeline_module(program: Program, plan: Plan, scheduler: CommScheduler, ep_rank: int) -> PipelineModule:
    """This rank's stage, with its own expert shards (expert parallelism inside the stage)."""
    stage_index = plan.topology.coordinates(scheduler.rank)[0]
    stage = program.annotations["pipeline"].stages[stage_index]
    view = copy.copy(program)
    view.gm = stage.gm
    shards = program.annotations.get("shards", {})
    view.annotations = {**program.annotations, "shards": {t: spec for t, spec in shards.items() if t in stage.parameters}}
    placement = shard_parameters(view, ep_rank)
    return PipelineModule(program, plan, scheduler, placement, compile_training)


def _has_no_rows(tensors) -> bool:
    return any(t.dim() and t.shape[0] == 0 for t in tensors)


def stand_in_row(t: torch.Tensor) -> torch.Tensor:
    """One row of zeros shaped like `t`'s rows (token id 0, zero features)."""
    return t.new_zeros((1, *t.shape[1:]))


def _check_same_graph(scheduler: CommScheduler, program: Program) -> None:
    """Every rank must issue the same collectives in the same order, or they mismatch and
    hang. Graphs may differ in shapes (a batch of 1 specialises), not in this skeleton."""
    graphs = [s.gm for s in program.annotations["pipeline"].stages] if "pipeline" in program.annotations else [program.gm]
    texts = scheduler.all_gather_object("\n".join(collective_skeleton(gm) for gm in graphs))
    if len(set(texts)) > 1:
        other = next(i for i, t in enumerate(texts) if t != texts[0])
        diff = difflib.unified_diff(texts[0].splitlines(), texts[other].splitlines(), "rank 0", f"rank {other}", lineterm="", n=0)
        raise PlanError(
            f"rank 0 and rank {other} rewrote the model into graphs with different collectives, which would "
            "hang; a pass made a rank-dependent choice. First differences:\n" + "\n".join(list(diff)[:12])
        )


def collective_skeleton(gm: torch.fx.GraphModule) -> str:
    """The graph's communication ops in order, with their constant arguments."""
    lines = []
    for node in gm.graph.nodes:
        if is_collective(node):
            constants = [a for a in node.args if isinstance(a, (str, int, float))]
            lines.append(f"{node.target}{tuple(constants)}")
    return "\n".join(lines)
