"""What every peer shares: the refusal a peer raises for a model it cannot express, and the
check that a peer computes the single-process model's function before it is timed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class PeerUnsupported(ValueError):
    """The peer cannot express this model or option; the message names what and why."""


@dataclass
class PeerCheck:
    """A peer against the single-process model on the same global batch, over one training step.

    Every figure is a difference relative to the reference tensor's largest entry
    (max |peer - reference| / max |reference|), the maximum over ranks:

    - `output_diff`, `loss_diff`, `grad_diffs` (gradients after the peer's own reduction):
      against the model on the whole batch, judged at `tolerance` (`tolerance_reason` says why:
      exact float64, or a part the peer computes in float32);
    - `step_diffs`: each parameter after the peer's optimizer step against the model's initial
      parameter stepped by torch's AdamW (the same hyperparameters) from the peer's gradient,
      judged at `step_tolerance`: the peer applies the same optimizer to every parameter;
    - `model_step_diffs`: each parameter after the peer's step against the model's after its own
      step. Reported, and judged at `tolerance` only when the peer is exact (`tolerance` equals
      `step_tolerance`): AdamW's first step is lr * g / (|g| + eps), which turns a float32
      rounding of a gradient entry near zero into a larger change of its update.
    """

    peer: str
    tolerance: float
    tolerance_reason: str
    step_tolerance: float = 1e-10
    output_diff: float = 0.0
    loss_diff: float = 0.0
    grad_diffs: dict[str, float] = field(default_factory=dict)
    step_diffs: dict[str, float] = field(default_factory=dict)
    model_step_diffs: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """What is over its tolerance (NaN is never within one)."""
        bad = [f"output {self.output_diff:.3g}"] if not self.output_diff <= self.tolerance else []
        bad += [f"loss {self.loss_diff:.3g}"] if not self.loss_diff <= self.tolerance else []
        bad += [f"gradient of {n} {d:.3g}" for n, d in self.grad_diffs.items() if not d <= self.tolerance]
        bad += [f"{n} after the step {d:.3g}" for n, d in self.step_diffs.items() if not d <= self.step_tolerance]
        if self.tolerance <= self.step_tolerance:
            bad += [f"{n} against the model's step {d:.3g}" for n, d in self.model_step_diffs.items() if not d <= self.tolerance]
        return bad

    @property
    def ok(self) -> bool:
        return bool(self.grad_diffs) and bool(self.step_diffs) and not self.failures()

    def line(self) -> str:
        def worst(diffs: dict[str, float]) -> float:
            return max(diffs.values(), default=float("nan"))

        verdict = "equal" if self.ok else "NOT equal: " + ", ".join(self.failures()[:4])
        return (f"{self.peer}: {verdict} to the single-process model (output {self.output_diff:.2g}, loss {self.loss_diff:.2g}, "
                f"gradients {worst(self.grad_diffs):.2g}: tolerance {self.tolerance:.2g}, {self.tolerance_reason}; "
                f"optimizer step from those gradients {worst(self.step_diffs):.2g}: tolerance {self.step_tolerance:.2g}; "
                f"parameters against the model's own step {worst(self.model_step_diffs):.2g})")


def relative_diff(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| relative to reference's largest entry (absolute where it is 0)."""
    value, reference = value.detach().double(), reference.detach().double()
    if value.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(value.shape)} against the reference's {tuple(reference.shape)}")
    if reference.numel() == 0:
        return 0.0
    scale = reference.abs().max().item()
    diff = (value - reference).abs().max().item()
    return diff / scale if scale > 0 else diff
