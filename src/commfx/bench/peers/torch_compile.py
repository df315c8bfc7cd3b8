"""Peer `compile`: the plain model under `torch.compile(model)` (dynamo and Inductor, the
default backend) in one process, trained with torch's (uncompiled) AdamW on the whole batch:
the torch.compile column of a compute table at world 1 (issue 42). Checked in float64 against
the single-process model, at float32's resolution: where a model casts to float32 itself (HF's
RMSNorm and rotary embedding do), eager rounds and Inductor's fused kernels do not. The optimizer
step from the peer's gradients is judged exactly.

The model is compiled when the runner is built, by one forward and backward whose gradients are
dropped (the parameters are untouched), so no timed step compiles; how long that took is
reported beside the timings. `peer:compile:mode=max-autotune` passes a `torch.compile` mode.
Like `peer:eager` it refuses a world of more than one rank.

Experts dynamo cannot trace at their eager speed stay eager: the built-in gpt-moe's experts run
one grouped matmul eagerly (`torch._grouped_mm`), whose fake implementation takes bfloat16 only,
so under a trace they take their per-row weight gather, a copy of an expert's weights per routed
row, many times slower than the eager step. By default (`experts=eager`) those
modules are left out of the graph (`torch.compiler.disable`), as a user does with an op the
compiler handles worse than eager; `experts=traced` compiles the model as written. HF experts
(`grouped_mm` as transformers builds them) trace whole and are compiled either way.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .common import PeerCheck, PeerUnsupported
from .eager import EagerPeer, check_single, single_process

NAME = "compile"
OPTIONS = {"mode": "default", "experts": "eager"}  # mode: torch.compile's ("default" passes none); experts: see above
EXPERTS = ("eager", "traced")
TOLERANCE = 64 * torch.finfo(torch.float32).eps
TOLERANCE_REASON = ("float64, but a model's own float32 casts (HF's RMSNorm and rotary embedding compute in float32) "
                    "are rounded in eager and skipped inside Inductor's fused kernels")


def _mode(mode: str) -> str | None:
    """torch.compile's `mode` argument for the option's text (PeerUnsupported naming the modes otherwise)."""
    from torch._inductor import list_mode_options

    if mode != "default" and mode not in list_mode_options():
        raise PeerUnsupported(f"torch.compile has no mode {mode!r}: its modes are {', '.join(sorted(list_mode_options()))}")
    return None if mode == "default" else mode


def _experts(experts: str) -> str:
    if experts not in EXPERTS:
        raise PeerUnsupported(f"experts={experts!r}: use {' or '.join(EXPERTS)}")
    return experts


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None,
              mode: str = "default", experts: str = "eager") -> None:
    """One rank, and options torch.compile knows; whether dynamo captures the model shows when it compiles."""
    single_process(NAME, world_size)
    _mode(mode)
    _experts(experts)


def eager_experts(module: nn.Module) -> int:
    """Leave the built-in experts that run a grouped matmul eagerly out of the compiled graph
    (each a graph break); returns how many."""
    from ...models.gpt_moe import Experts

    found = [m for m in module.modules() if isinstance(m, Experts) and m.implementation == "grouped_mm"]
    for m in found:
        m.forward = torch.compiler.disable(m.forward)
    return len(found)


class CompilePeer(EagerPeer):
    """The model (a copy) called through `torch.compile`, compiled before any timed step."""

    name = NAME
    tolerance = TOLERANCE
    tolerance_reason = TOLERANCE_REASON

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0,
                 mode: str = "default", experts: str = "eager"):
        self.mode, self.experts, self.eager_experts = _mode(mode), _experts(experts), 0
        super().__init__(model, inputs, ep_size=ep_size, lr=lr, capacity_factor=capacity_factor)
        start = time.perf_counter()
        self.forward_backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.compile_s = time.perf_counter() - start
        left_out = f", {self.eager_experts} experts modules run eagerly (experts=eager)" if self.eager_experts else ""
        self.notes = [f"torch.compile(model, backend='inductor', mode={self.mode!r}){left_out}: the first forward and "
                      f"backward, which compile, took {self.compile_s:.1f} s before timing (in no timed step)"]

    def wrap(self, module: nn.Module):
        if self.experts == "eager":
            self.eager_experts = eager_experts(module)
        return torch.compile(module, mode=self.mode)


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          mode: str = "default", experts: str = "eager", **_) -> PeerCheck:
    """The compiled model on the whole batch against the single-process model, in `dtype`."""
    check_ = check_single(CompilePeer, model, global_inputs, lr=lr, dtype=dtype, mode=mode, experts=experts)
    check_.notes.append(f"torch.compile(model, mode={_mode(mode)!r}, experts {experts}) in one process")
    return check_


Runner = CompilePeer  # the names every peer module gives the bench
