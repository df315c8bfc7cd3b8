"""Lowering: aot_autograd splits a rewritten graph into forward and backward graphs.

Schedule passes work on these (`overlap_collectives`: split-phase all-to-alls started
early, waited late), the runtime runs them, and `commfx dump --stage forward|backward`
shows them. Tracing runs on fake tensors with a shape environment, so data-dependent sizes
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

from ..passes.schedule.overlap import overlap_collectives
from .program import Program
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
) -> Callable:
    """aot_autograd over `gm`; each scheduled graph goes to `forward`/`backward`, which
    return the callable that runs it. Returns the differentiable compiled function.

    `fake_inputs`: the inputs already are fake tensors in a tracing context (dynamo's);
    otherwise they are real and traced here, with symbolic sizes if `dynamic`.
    """

    def scheduled(runner: GraphRunner):
        def compiler(graph: fx.GraphModule, _example):
            overlap_collectives(graph)
            return make_boxed_func(runner(graph))  # aot_autograd's calling convention: one list of args

        return compiler

    compilers = {"fw_compiler": scheduled(forward), "bw_compiler": scheduled(backward)}
    if fake_inputs:
        return aot_module_simplified(gm, list(example_inputs), **compilers)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t, static_shapes=not dynamic) for t in example_inputs]
    with torch._guards.tracing(torch._guards.TracingContext(mode)), torch.enable_grad():
        return aot_module_simplified(gm, fakes, **compilers)


def lower(program: Program, example_inputs: tuple[torch.Tensor, ...]) -> Lowered:
    """Scheduled forward and backward graphs of `program` (as rank 0 sees its shapes)."""
    program = copy.copy(program)
    program.gm = copy.deepcopy(program.gm)
    shard_parameters(program, 0)
    graphs: dict[str, fx.GraphModule] = {}

    def keep(name):
        def runner(gm: fx.GraphModule):
            graphs[name] = gm
            return gm

        return runner

    compile_training(program.gm, example_inputs, forward=keep("forward"), backward=keep("backward"), dynamic=True)
    if "backward" not in graphs:
        raise RuntimeError("aot_autograd produced no backward graph (does any parameter require grad?)")
    return Lowered(graphs["forward"], graphs["backward"])
