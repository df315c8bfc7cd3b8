"""Lowering: aot_autograd splits a rewritten graph into forward and backward graphs.

Schedule passes (collective ordering, kernel choice) work on these, and `commfx dump
--stage forward|backward` shows them: the backward all-to-alls appear here. Tracing runs
on fake tensors with a shape environment, so data-dependent sizes (all-to-all outputs)
become unbacked symbols rather than errors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .program import Program
from .runtime.module import shard_parameters


@dataclass
class Lowered:
    forward: fx.GraphModule
    backward: fx.GraphModule


def lower(program: Program, example_inputs: tuple[torch.Tensor, ...]) -> Lowered:
    """Forward and backward graphs of `program` (as rank 0 sees its shapes)."""
    program = copy.copy(program)
    program.gm = copy.deepcopy(program.gm)
    shard_parameters(program, ep_rank=0)
    graphs: dict[str, fx.GraphModule] = {}

    def keep(name):
        def compiler(gm: fx.GraphModule, _example):
            graphs[name] = gm
            return gm

        return compiler

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fake_inputs = tuple(mode.from_tensor(t) for t in example_inputs)
    with torch._guards.tracing(torch._guards.TracingContext(mode)):
        aot_module_simplified(program.gm, fake_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    if "backward" not in graphs:
        raise RuntimeError("aot_autograd produced no backward graph (does any parameter require grad?)")
    return Lowered(graphs["forward"], graphs["backward"])
