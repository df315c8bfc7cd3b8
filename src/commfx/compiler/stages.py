"""Pipeline stages and the boundaries between them: the IR `pipeline_split` produces.

A `Stage` is a graph module of its own (lowered on its own, aot_autograd forward and
backward); it names what it reads (model inputs, read locally from the micro-batch, and
values received from the previous stage) and what it produces. A `Boundary` is what one
stage hands the next: named tensors forward, their gradients backward. Values a later
stage needs are forwarded stage by stage, so traffic only flows between neighbours.

A boundary is a first-class object so passes can change what travels without touching the
runtime: `compress_pipeline` gives it a `codec` that turns the backward gradients into
low-rank factors and back, and the runtime sends whatever the codec makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

INPUT_PREFIX = "input:"  # a stage input read from the micro-batch (a model input), not received


@dataclass
class BoundaryTensor:
    name: str  # the value's node name in the unsplit graph
    dtype: torch.dtype
    requires_grad: bool  # a gradient travels back (floating and downstream of a trainable parameter)
    origin: str = ""  # the module that produced it, for dumps
    shape: str = ""  # symbolic shape as traced, for dumps
    ndim: int = 0


@dataclass
class Boundary:
    """What stage `index` sends to stage `index + 1` (and gets gradients of back)."""

    index: int
    tensors: list[BoundaryTensor]
    # Set by a pass to change the backward payload (see ops.compress.LowRankCodec):
    # encode(grads, state, critical) -> payload, decode(payload, specs, critical) -> grads.
    codec: Any = None

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def grad_names(self) -> list[str]:
        return [t.name for t in self.tensors if t.requires_grad]


@dataclass
class Stage:
    index: int
    gm: fx.GraphModule
    inputs: list[str]  # placeholder order: "input:<model input name>" or a boundary tensor name
    outputs: list[str]  # what the graph returns, in order (values produced here)
    parameters: list[str] = field(default_factory=list)  # qualified names of the parameters it holds
    layers: list[int] = field(default_factory=list)  # the model's layers it runs
    # Set by a pass to reduce this stage's data-parallel gradients itself (see
    # ops.powersgd_allreduce.DataParallelPowerSGD): compresses(shape, dtype) picks the
    # gradients, reduce(grads, state, all_reduce, group_size, scale) reduces them.
    dp_codec: Any = None


@dataclass
class Pipeline:
    """Everything the runtime needs to run the model as a pipeline."""

    stages: list[Stage]
    boundaries: list[Boundary]  # boundaries[k] sits between stages k and k + 1
    model_outputs: list[str]  # the model's flat outputs, by value name (the last stage holds them)
    schedule: str = "1f1b"
    microbatches: int = 1
    # parameter -> stages holding a copy (a weight tied across stages: its gradient is summed)
    shared: dict[str, list[int]] = field(default_factory=dict)
    # Optimus-CC's fused embedding synchronisation: tied weights reduce in one all-reduce over
    # the first and last stage of every pipeline instead of dp then first<->last.
    fuse_shared_sync: bool = False

    def describe(self) -> str:
        """The stages and boundaries as text (dumps and golden files)."""
        lines = [f"pipeline: {len(self.stages)} stages, schedule {self.schedule}, {self.microbatches} micro-batches"]
        for stage in self.stages:
            lines.append(
                f"stage {stage.index}: layers {stage.layers}, {len(stage.parameters)} parameters, "
                f"inputs {stage.inputs}, outputs {stage.outputs}"
            )
            if stage.dp_codec is not None:
                lines.append(f"  data-parallel gradients: {stage.dp_codec}")
            if stage.index < len(self.boundaries):
                boundary = self.boundaries[stage.index]
                codec = f" backward codec {boundary.codec}" if boundary.codec is not None else ""
                lines.append(f"boundary {boundary.index} -> {boundary.index + 1}:{codec}")
                for t in boundary.tensors:
                    grad = "grad back" if t.requires_grad else "no grad"
                    lines.append(f"  {t.name}: {str(t.dtype).removeprefix('torch.')}{t.shape} from {t.origin or '?'} ({grad})")
        if self.shared:
            lines.append(f"shared across stages: {self.shared}" + (" (fused sync)" if self.fuse_shared_sync else ""))
        return "\n".join(lines) + "\n"
