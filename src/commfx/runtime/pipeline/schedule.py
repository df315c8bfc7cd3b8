"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B)
of each micro-batch. Semantics follow torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B (tests compare the two on the same micro-batches).

- GPipe: every forward, then every backward, micro-batches in order.
- 1F1B (PipeDream-Flush): stage s runs min(stages - 1 - s, M) warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards (the
  cool-down). At most stages - s micro-batches are in flight, so activation memory is
  bounded by the depth instead of M.

Which backward sends are on the critical path (Optimus-CC's "epilogue"): those a stage
makes after its last forward. In 1F1B these are the cool-down backwards plus the last
steady-state one, when nothing else is left to overlap them with; in GPipe every
backward comes after the last forward.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """Stage `stage`'s actions, in order."""
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(stages - 1 - stage, m)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warmup, m)]
        return order
    raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def critical_backwards(schedule: str, stage: int, stages: int, microbatches: int) -> set[int]:
    """Micro-batches whose backward send from `stage` is on the critical path (see module doc)."""
    order = actions(schedule, stage, stages, microbatches)
    last_forward = max(i for i, a in enumerate(order) if a.kind == "F")
    return {a.microbatch for a in order[last_forward + 1 :] if a.kind == "B"}
