"""Timelines: what one rank computed and communicated, as a Chrome / Perfetto trace.

Open the JSON in https://ui.perfetto.dev or chrome://tracing. Each rank is a process with
separate tracks: graph compute (one slice per node, forward and backward), time the
graph spent blocked on communication, and one track per priority class showing each
collective from issue to completion (kind, group, bytes, chunk tag), plus a track of the
time collectives sat queued behind others. Where an all-to-all pre-empts gradient
all-reduce, the `grad` track shows a gap that the `a2a` track fills.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.fx as fx

from ..plan import PRIORITY_CLASSES
from .priority import Pending

TRACK_COMPUTE, TRACK_BLOCKED = 1, 2
_TRACK_NAMES = {TRACK_COMPUTE: "compute", TRACK_BLOCKED: "blocked on communication"}


@dataclass
class ComputeSpan:
    name: str
    op: str
    phase: str
    start: float
    end: float
    blocked: bool


class Timeline:
    """Collects compute spans from the graph executor; collectives come from the dispatcher."""

    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[ComputeSpan] = []
        self.steps: list[tuple[int, float, float]] = []

    def compute(self, node: fx.Node, phase: str, start: float, end: float, *, blocked: bool = False) -> None:
        self.spans.append(ComputeSpan(node.name, op_label(node), phase, start, end, blocked))

    def step(self, index: int, start: float, end: float) -> None:
        self.steps.append((index, start, end))

    def chrome_events(self, collectives: list[Pending]) -> list[dict]:
        pid = self.rank
        events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {self.rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": self.rank}},
        ]
        tracks = dict(_TRACK_NAMES)
        for name, cls in PRIORITY_CLASSES.items():
            tracks[_comm_track(name)] = f"comm: {name} (level {cls.level})"
            tracks[_queue_track(name)] = f"queued: {name}"
        tracks[0] = "steps"
        for tid, name in sorted(tracks.items()):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for index, start, end in self.steps:
            events.append(self._slice(f"step {index}", 0, start, end, {}))
        for span in self.spans:
            tid = TRACK_BLOCKED if span.blocked else TRACK_COMPUTE
            events.append(self._slice(span.op, tid, span.start, span.end, {"node": span.name, "phase": span.phase}))
        for c in collectives:
            args = {"kind": c.kind, "class": c.priority, "group": c.group, "bytes": c.nbytes, "chunk": c.tag}
            label = f"{c.kind} {c.tag}".strip()
            if c.t_issue > c.t_submit:
                events.append(self._slice(f"queued {label}", _queue_track(c.priority), c.t_submit, c.t_issue, args))
            events.append(self._slice(label, _comm_track(c.priority), c.t_issue, c.t_done, args))
        return events

    def _slice(self, name: str, tid: int, start: float, end: float, args: dict) -> dict:
        return {
            "ph": "X",
            "name": name,
            "pid": self.rank,
            "tid": tid,
            # absolute monotonic time: ranks on one host (or emulated cluster) share the clock,
            # so merged traces line up
            "ts": round(start * 1e6, 3),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "args": args,
        }

    def write(self, path: str | Path, collectives: list[Pending]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self.chrome_events(collectives), "displayTimeUnit": "ms"}))
        return path


def op_label(node: fx.Node) -> str:
    """commfx.expert_ffn, aten.mm, operator.add: short and stable, like `commfx dump`."""
    target = node.target
    if isinstance(target, str):
        return f"{node.op} {target}"
    namespace = getattr(target, "namespace", None)
    if namespace is not None:  # an OpOverload
        return f"{namespace}.{target._opname}"
    return f"{getattr(target, '__module__', '') or ''}.{getattr(target, '__name__', str(target))}".lstrip(".")


def _comm_track(priority: str) -> int:
    return 10 + 2 * sorted(PRIORITY_CLASSES, key=lambda n: PRIORITY_CLASSES[n].level).index(priority)


def _queue_track(priority: str) -> int:
    return _comm_track(priority) + 1


def rank_trace_path(path: str | Path, rank: int) -> Path:
    """out/trace.json -> out/trace.rank3.json"""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")


def merge_traces(rank_paths: list[Path], out: str | Path) -> Path:
    """One file with every rank as its own process (they share the host's monotonic clock)."""
    events = []
    for p in rank_paths:
        events.extend(json.loads(Path(p).read_text())["traceEvents"])
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
