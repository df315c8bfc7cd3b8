"""Peer `compile`: the plain model under `torch.compile(model)` (dynamo and Inductor, the
default backend) in one process, trained with torch's (uncompiled) AdamW on the whole batch:
the torch.compile column of a compute table at world 1 (issue 42). Checked in float64 against
the single-process model; Inductor fuses and reorders the same sums.

The model is compiled when the runner is built, by one forward and backward whose gradients are
dropped (the parameters are untouched), so no timed step compiles; how long that took is
reported beside the timings. `peer:compile:mode=max-autotune` passes a `torch.compile` mode.
Like `peer:eager` it refuses a world of more than one rank.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .common import PeerCheck, PeerUnsupported
from .eager import EagerPeer, check_single, single_process

NAME = "compile"
OPTIONS = {"mode": "default"}  # torch.compile's mode; "default" passes none
TOLERANCE = 1e-10  # float64, Inductor's fused kernels summing in their own order
TOLERANCE_REASON = "float64; Inductor fuses and reorders the same sums"


def _mode(mode: str) -> str | None:
    """torch.compile's `mode` argument for the option's text (PeerUnsupported naming the modes otherwise)."""
    from torch._inductor import list_mode_options

    if mode != "default" and mode not in list_mode_options():
        raise PeerUnsupported(f"torch.compile has no mode {mode!r}: its modes are {', '.join(sorted(list_mode_options()))}")
    return None if mode == "default" else mode


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None,
              mode: str = "default") -> None:
    """One rank, and a mode torch.compile knows; whether dynamo captures the model shows when it compiles."""
    single_process(NAME, world_size)
    _mode(mode)


class CompilePeer(EagerPeer):
    """The model (a copy) called through `torch.compile`, compiled before any timed step."""

    name = NAME
    tolerance = TOLERANCE
    tolerance_reason = TOLERANCE_REASON

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0,
                 mode: str = "default"):
        self.mode = _mode(mode)
        super().__init__(model, inputs, ep_size=ep_size, lr=lr, capacity_factor=capacity_factor)
        start = time.perf_counter()
        self.forward_backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.compile_s = time.perf_counter() - start
        self.notes = [f"torch.compile(model, backend='inductor', mode={self.mode!r}): the first forward and backward, "
                      f"which compile, took {self.compile_s:.1f} s before timing (in no timed step)"]

    def wrap(self, module: nn.Module):
        return torch.compile(module, mode=self.mode)


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          mode: str = "default", **_) -> PeerCheck:
    """The compiled model on the whole batch against the single-process model, in `dtype`."""
    check_ = check_single(CompilePeer, model, global_inputs, lr=lr, dtype=dtype, mode=mode)
    check_.notes.append(f"torch.compile(model, mode={_mode(mode)!r}) in one process")
    return check_


Runner = CompilePeer  # the names every peer module gives the bench
