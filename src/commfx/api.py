"""The Python API: distribute a model over the current world (and, re-exported, compile it
with a plan in one process: `commfx.compile_program`)."""

from __future__ import annotations

import copy
import dataclasses
import difflib

import torch
import torch.distributed as dist

from .compiler.capture import capture, split_inputs, tokens_of
from .compiler.lower import compile_training
from .compiler.pipeline import compile_program
from .compiler.program import Program
from .compiler.sharding import shard_parameters
from .compiler.pass_manager import check_plan
from .cost.moe import host_chunk_overhead
from .plan import Plan, PlanError, said_once_per_node
from .runtime import rank_errors
from .runtime.comm import CommScheduler, build_groups
from .runtime.devices import module_device_type
from .runtime.machine_probe import expert_work_shape, measure, measured_topology
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
    model, a `ModelOutput` with `logits`, and `loss` when labels are passed). Called later
    with another set of tensor inputs (`labels=` added for training, left out for eval), it
    re-captures the model for that set once and keeps both programs, which share the
    parameters; every rank must make the same call, as with any collective.

    `replicas`: every rank must start from the same model. "check" (default) compares a
    digest of every parameter and buffer across ranks and names those that differ;
    "broadcast" gives every rank rank 0's values first; "off" skips both.
    """
    rank_errors.install()  # under torchrun, a commfx error every rank hits prints once
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
    try:
        check_plan(plan, model)
    except PlanError as error:
        raise said_once_per_node(error) from None
    rank = dist.get_rank()
    device_type = module_device_type(model)  # CUDA: NCCL lanes on streams (runtime/stream_lanes.py)
    groups = build_groups(plan.topology, rank, timeout_s=plan.collective_timeout_s, device_type=device_type)
    scheduler = CommScheduler(plan.topology, rank, groups, timeout_s=plan.collective_timeout_s, device_type=device_type)
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
    measured, captured = None, None
    if plan.machine == "measure":  # the cost models read this machine's figures, agreed by every rank
        captured = capture(model, args, kwargs)
        lifted = compile_program(model, plan, args, kwargs, tokens_per_rank=tokens, captured=captured, stop_after="lift")
        shape = expert_work_shape(lifted, tokens)  # timed at the model's own expert shape
        device = next(model.parameters()).device
        measured = measure(scheduler, plan.topology, _compute_dtype(model, plan), device, shape)
        plan = dataclasses.replace(plan, topology=measured_topology(plan.topology, measured, host_chunk_overhead(device.type)))
    program = compile_program(model, plan, args, kwargs, tokens_per_rank=tokens, captured=captured)
    if measured is not None:
        program.notes.append(measured.describe())
    program.parent = None  # the programs before each pass hold the full-size weights sharding is about to drop
    _check_same_graph(scheduler, program)
    ranks = {name: handle.rank for name, handle in groups.items() if "/" not in name}
    if program.regions.pipeline is not None:
        return _pipeline_module(program, plan, scheduler, ranks)
    placement = shard_parameters(program, ranks)
    recapture = _recapture_for(model, program, plan, scheduler, tokens)
    return DistributedModule(program, plan, scheduler, placement, compile_training, recapture)


def _compute_dtype(model: torch.nn.Module, plan: Plan) -> torch.dtype:
    """The dtype the model's matmuls run in: the plan's precision, else its parameters'."""
    from .compiler.precision import precision_dtype

    return precision_dtype(plan.precision) if plan.precision != "fp32" else next(model.parameters()).dtype


def _recapture_for(model: torch.nn.Module, program: Program, plan: Plan, scheduler: CommScheduler, tokens: int):
    """The `recapture(args, kwargs) -> Program` a DistributedModule calls for a new set of
    tensor inputs: capture and the plan's passes for them, on every rank.

    What it traces is a skeleton of `model` kept from now on, not the model: a copy of its
    module tree whose replicated parameters and buffers are the very objects the rewritten
    module holds (capture made them its attributes; no copy), and whose sharded parameters
    are full-shape stand-ins over one zero (`torch.zeros(()).expand(shape)`, no memory).
    Capture and the passes read only shapes, dtypes and devices of those (dynamo traces on
    fake tensors; cost models read sizes); the sharded values they never see. Keeping the
    user's model instead would keep every full expert alive, which `distribute` exists to
    avoid; the program's `modules` now point into the skeleton too, for the same reason.
    The new program's graph module then takes this module's own parameters (expert shards
    included) by name, so an optimizer over `dm.parameters()` trains every program."""
    shards = program.runtime.shards
    try:
        skeleton = _skeleton(model, shards)
    except Exception as error:  # a model deepcopy cannot copy (a lock, a process group, ...)
        unavailable = f"{type(model).__name__} cannot be copied into a skeleton to re-capture ({type(error).__name__}: {error})"
        skeleton = None
    program.modules = dict(skeleton.named_modules()) if skeleton is not None else {}

    def recapture(args: tuple, kwargs: dict) -> Program:
        if skeleton is None:
            raise PlanError(f"{unavailable}; call the module with the same inputs every step, or distribute again")
        kwargs = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}  # settings such as return_dict stay out
        if _has_no_rows((*args, *kwargs.values())):
            args, kwargs = tuple(stand_in_row(t) for t in args), {k: stand_in_row(t) for k, t in kwargs.items()}
        new = compile_program(skeleton, plan, args, kwargs, tokens_per_rank=tokens)  # tokens: the choices distribute made
        new.parent = None
        _check_same_graph(scheduler, new)
        if new.regions.pipeline is not None:
            raise PlanError("re-capture for new inputs is not supported with pipeline_split yet")
        _share_parameters(new, program)
        return new

    return recapture


def _skeleton(model: torch.nn.Module, shards: dict) -> torch.nn.Module:
    """A copy of `model` that shares every parameter and buffer with it, except the sharded
    ones (by qualified name, as capture named them), which become full-shape stand-ins."""
    memo: dict[int, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) in memo:
            continue  # tied: the first name is the one capture used
        if name in shards:
            stand_in = torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
            memo[id(tensor)] = torch.nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
        else:
            memo[id(tensor)] = tensor
    return copy.deepcopy(model, memo)


def _share_parameters(new: Program, first: Program) -> None:
    """Give `new`'s graph module `first`'s parameter and buffer objects, by qualified name."""
    before, after = first.runtime.shards, new.runtime.shards
    if before != after:
        differ = sorted(n for n in {*before, *after} if before.get(n) != after.get(n))
        raise PlanError(
            f"for the new inputs the plan's passes shard parameters differently ({', '.join(differ[:4])}): a "
            "cost model chose otherwise for this graph. Pin that pass's choice in the plan, or call the module "
            "with the same inputs every step"
        )
    params = dict(first.gm.named_parameters(remove_duplicate=False))
    unknown = [n for n, _ in new.gm.named_parameters(remove_duplicate=False) if n not in params]
    if unknown:
        raise PlanError(
            f"with the new inputs the model uses parameters it did not use before ({', '.join(unknown[:4])}), "
            "which this module does not hold; distribute with these inputs"
        )
    buffers = dict(first.gm.named_buffers(remove_duplicate=False))
    for name, _ in list(new.gm.named_parameters(remove_duplicate=False)):
        owner_path, _, leaf = name.rpartition(".")
        new.gm.get_submodule(owner_path)._parameters[leaf] = params[name]
    for name, _ in list(new.gm.named_buffers(remove_duplicate=False)):
        owner_path, _, leaf = name.rpartition(".")
        if name in buffers:
            new.gm.get_submodule(owner_path)._buffers[leaf] = buffers[name]


def _pipeline_module(program: Program, plan: Plan, scheduler: CommScheduler, ranks: dict[str, int]) -> PipelineModule:
    """This rank's stage, with its own expert and tensor-parallel shards (`ranks`: this
    rank's index in each group, as `shard_parameters` takes it)."""
    stage_index = plan.topology.coordinates(scheduler.rank)[0]
    stage = program.regions.pipeline.stages[stage_index]
    shards = {t: spec for t, spec in program.runtime.shards.items() if t in stage.parameters}
    view = dataclasses.replace(program, gm=stage.gm, runtime=dataclasses.replace(program.runtime, shards=shards))
    placement = shard_parameters(view, ranks)
    return PipelineModule(program, plan, scheduler, placement, compile_training)


def _has_no_rows(tensors) -> bool:
    return any(t.dim() and t.shape[0] == 0 for t in tensors)


def stand_in_row(t: torch.Tensor) -> torch.Tensor:
    """One row of zeros shaped like `t`'s rows (token id 0, zero features)."""
    return t.new_zeros((1, *t.shape[1:]))


def _check_same_graph(scheduler: CommScheduler, program: Program) -> None:
    """Every rank must issue the same collectives in the same order, or they mismatch and
    hang. Graphs may differ in shapes (a batch of 1 specialises), not in this skeleton."""
    pipeline = program.regions.pipeline
    graphs = [s.gm for s in pipeline.stages] if pipeline is not None else [program.gm]
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
