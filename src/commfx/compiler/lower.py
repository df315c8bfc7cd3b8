"""Lowering: aot_autograd splits a rewritten graph into forward and backward graphs.

Schedule passes work on these (`overlap_collectives`: split-phase all-to-alls started
early, waited late), then, under `Plan(compute="inductor")`, the compute between
collectives and runtime hooks is compiled in regions (`compile_regions`); the runtime runs
them, and `commfx dump --stage forward|backward` shows them (with their regions). Tracing runs on fake tensors with a shape environment, so data-dependent sizes
(all-to-all outputs) become unbacked symbols rather than errors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..ops.decompositions import compute_decompositions
from ..passes.schedule.overlap import overlap_collectives
from ..plan import COMPUTE_MODES, default_compute
from .compile_regions import HookPoints, Hooks, compile_regions, default_hooks, mark_regions
from .program import Program
from .remat import partition_fn
from .shared_gemms import merging_gemms
from .sharding import shard_parameters

GraphRunner = Callable[[fx.GraphModule], Callable]


@dataclass
class Lowered:
    forward: fx.GraphModule
    backward: fx.GraphModule


def compile_training(
    gm: torch.nn.Module,
    example_inputs,
    *,
    forward: GraphRunner,
    backward: GraphRunner,
    fake_inputs: bool = False,
    dynamic: bool = False,
    compute: str | None = None,
    hooks: HookPoints | None = None,
    activation_memory_budget: float | None = None,
    decompose: bool | None = None,
) -> Callable:
    """aot_autograd over `gm`; each scheduled graph goes to `forward`/`backward`, which
    return the callable that runs it. Returns the differentiable compiled function.

    `fake_inputs`: the inputs already are fake tensors in a tracing context (dynamo's);
    otherwise they are real and traced here, with symbolic sizes if `dynamic`.
    `compute`: "inductor" compiles each graph's regions before its runner sees it (default:
    `plan.default_compute()`); `hooks(graph, phase)` -> (nodes a region starts at, nodes it
    ends after): where the runtime acts in that graph (default: after every gradient output
    in backward). `activation_memory_budget`: the plan's; the forward saves about that share
    of its activations and the backward recomputes the rest (`remat`; None saves all).
    `decompose` (default: compute is "inductor"): open commfx's compute ops into aten ops
    around the grouped GEMMs (`ops/decompositions.py`) for Inductor to fuse.
    """
    compute = compute or default_compute()
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_MODES)}, got {compute!r}")

    def scheduled(runner: GraphRunner, phase: str):
        def compiler(graph: fx.GraphModule, _example):
            overlap_collectives(graph)
            if compute == "inductor":
                compile_regions(graph, phase, Hooks(*hooks(graph, phase)) if hooks is not None else None)
            return make_boxed_func(runner(graph))  # aot_autograd's calling convention: one list of args

        return compiler

    compilers = {"fw_compiler": scheduled(forward, "forward"), "bw_compiler": scheduled(backward, "backward"),
                 "partition_fn": partition_fn(activation_memory_budget)}
    if decompose is None:
        decompose = compute == "inductor"
    if decompose:
        compilers["decompositions"] = compute_decompositions()
        compilers["partition_fn"] = merging_gemms(compilers["partition_fn"])
    if fake_inputs:
        return aot_module_simplified(gm, list(example_inputs), **compilers)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t, static_shapes=not dynamic) for t in example_inputs]
    with torch._guards.tracing(torch._guards.TracingContext(mode)), torch.enable_grad():
        return aot_module_simplified(gm, fakes, **compilers)


def lower(
    program: Program, example_inputs: tuple[torch.Tensor, ...], *, compute: str = "interpret", activation_memory_budget: float | None = None
) -> Lowered:
    """Scheduled forward and backward graphs of `program` (as rank 0 sees its shapes), split
    under `activation_memory_budget` (see `compile_training`). Under compute="inductor" their
    nodes are marked with the regions they would be compiled in (not compiled: `render` shows the cut)."""
    program = copy.copy(program)
    program.gm = copy.deepcopy(program.gm)
    shard_parameters(program, 0)
    graphs: dict[str, fx.GraphModule] = {}

    def keep(name):
        def runner(gm: fx.GraphModule):
            graphs[name] = gm
            return gm

        return runner

    compile_training(program.gm, example_inputs, forward=keep("forward"), backward=keep("backward"), dynamic=True, compute="interpret",
                     activation_memory_budget=activation_memory_budget, decompose=compute == "inductor")
    if "backward" not in graphs:
        raise RuntimeError("aot_autograd produced no backward graph (does any parameter require grad?)")
    if compute == "inductor":
        for phase, gm in graphs.items():
            mark_regions(gm, default_hooks(gm, phase))
    return Lowered(graphs["forward"], graphs["backward"])
