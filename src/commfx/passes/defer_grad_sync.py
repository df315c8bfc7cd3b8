"""defer_grad_sync: let the gradient all-reduce run on into the next step's forward.

Backward produces gradients in reverse layer order, so its all-reduce always ends with a
tail that nothing overlaps: the last buckets are still on the wire when backward is done,
and the optimizer waits for them. Yet the next forward needs a parameter only when it
reaches the layer that uses it, and the link is idle while the forward computes (EmbRace's
2D scheduling, the dense half; ByteScheduler and PyTorch's own "overlap optimizer with
forward" make the same observation). With this pass the runtime does not wait at the end
of backward: `optimizer.step()` updates the parameters whose gradients are in, and each
other parameter is updated by the same optimizer, with the hyperparameters it had at that
step, the moment the next forward first uses it (or at `synchronize()`, `state_dict()`, or
the next backward). Lossless: the same parameters after every step (float64 tests).

The graph does not change: the pass marks the program and the runtime does the rest
(`runtime/deferred_step.py`). The module must know the optimizer
(`dm.attach_optimizer(optimizer)`; `commfx run` and `commfx bench` do it), and nothing may
read gradients between backward and step (clip_grad_norm_ would see the deferred ones as
missing); without an attached optimizer gradients are reduced in backward as usual.
"""

from __future__ import annotations

import dataclasses

from .base import DEFERRED, RuntimeSetting, register

PASS = "defer_grad_sync"


# Facts of graphs whose optimizer step a deferred gradient cannot wait for (those passes refuse it too).
REFUSED = {
    "pipeline split": "a pipeline stage steps after its last micro-batch, where nothing of the next forward is left to overlap",
    "resizable tensor parallel": "both act between optimizer steps (a migration moves optimizer state that a deferred step "
                                 "has still to update)",
}


@register(PASS, setting="grad_sync", ensures=DEFERRED, refuses=REFUSED)
class DeferGradSync(RuntimeSetting):
    """Gradient all-reduce overlaps the next forward; each parameter updated at its first use."""

    @dataclasses.dataclass(frozen=True)
    class Options:
        enabled: bool = True

    @classmethod
    def ensured(cls, options: Options) -> tuple[str, ...]:
        return cls.ensures if options.enabled else ()

    @classmethod
    def refused(cls, options: Options) -> dict[str, str]:
        return cls.refuses if options.enabled else {}

    @classmethod
    def value(cls, options: Options) -> str:
        return "next_forward" if options.enabled else "backward"

    @classmethod
    def note(cls, options: Options) -> str | None:
        return ("the gradient all-reduce runs on into the next forward once dm.attach_optimizer(optimizer) is "
                "called; each parameter is stepped just before its first use there") if options.enabled else None
