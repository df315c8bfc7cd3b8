"""Priority classes and the dispatcher that issues collectives class by class (Lina).

Lina's rule: all-to-all blocks compute (experts wait for their tokens), gradient
all-reduce does not, so all-to-all goes first and all-reduce is cut into chunks that fill
the gaps. Every collective carries a priority class; each class is a *lane*:

- a lane issues its collectives one at a time, in the order they were submitted
  (a FIFO: chunk i's transfer never shares the link with chunk i+1 of the same class);
- with priority on, a lane issues its next collective only when every higher lane has
  nothing queued and nothing in flight. A low-priority chunk already on the wire is not
  interrupted: pre-emption happens only between chunks, so a waiting all-to-all is delayed
  by at most one chunk.

A class may split into sub-lanes (`Pending.lane`): pipeline point-to-point traffic has one
per direction, so a send waiting for its peer's receive never holds up a receive behind
it (gloo's send completes only once the peer has posted the receive). Sub-lanes of one
class do not hold each other back; each keeps submission order, the micro-batch order both
ends of a boundary share.

Why this cannot hang or mismatch: every class except the first runs on its own clones of
the process groups (`build_groups`), so a process group only ever sees one lane's
collectives, and a lane issues in submission order, which is the graph order and the
bucket order, the same on every rank. Priority only *delays* a lane; it never reorders
one. A high lane never waits for a low one, so high collectives always progress; a low
lane waits only for high collectives, which finish (or time out and raise).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..plan import PRIORITY_CLASSES, priority_class


@dataclass(eq=False)
class Pending:
    """One collective: queued, then issued, then done. Timestamps feed the trace."""

    kind: str
    priority: str
    group: str
    tag: str
    nbytes: int
    issue: Callable[[], object] | None  # starts the collective; returns a c10d Work or None when already done
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    t_submit: float = 0.0
    t_issue: float = 0.0
    t_done: float = 0.0
    lane: str = ""  # a lane of its own inside the class (pipeline sends and receives); "" = the class's lane
    work: object | None = None  # on a device-ordered lane (StreamLanes): the c10d work to wait on

    @property
    def lane_key(self) -> str:
        return f"{self.priority}/{self.lane}" if self.lane else self.priority


class Dispatcher:
    """Issues pending collectives lane by lane on a background thread (see module doc)."""

    device_ordered = False  # issues return host-side works (gloo): a thread waits on those without futures

    def __init__(self, enforce_priority: bool = True):
        self.enforce_priority = enforce_priority
        self.history: list[Pending] | None = None  # when a list, every finished collective (for traces)
        self._lanes: dict[str, deque[Pending]] = {}
        self._in_flight: dict[str, Pending | None] = {}
        self._class_of: dict[str, str] = {}  # lane -> its priority class
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, pending: Pending) -> Pending:
        priority_class(pending.priority)  # unknown classes fail here, on the caller's thread
        with self._cond:
            pending.t_submit = time.perf_counter()  # under the lock: ordered against issue decisions
            self._lanes.setdefault(pending.lane_key, deque()).append(pending)
            self._in_flight.setdefault(pending.lane_key, None)
            self._class_of[pending.lane_key] = pending.priority
            if self._thread is None:
                # The dispatcher and gloo's completion callbacks need the GIL to hand the wire to
                # the next collective; at Python's default 5 ms switch interval a busy main thread
                # would leave the link idle that long after every chunk.
                if sys.getswitchinterval() > 5e-4:
                    sys.setswitchinterval(5e-4)
                self._thread = threading.Thread(target=self._loop, name="commfx-dispatcher", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> bool:
        """Block the host until `pending` is done; False when `timeout_s` passed first."""
        return pending.done.wait(timeout_s)

    def _next(self) -> Pending | None:
        """The next collective allowed on the wire, or None (caller holds the lock)."""
        name = next_lane(self._lanes, self._in_flight, self._class_of, self.enforce_priority)
        if name is None:
            return None
        pending = self._in_flight[name] = self._lanes[name].popleft()
        pending.t_issue = time.perf_counter()
        return pending

    def _loop(self) -> None:
        while True:
            with self._cond:
                pending = self._next()
                while pending is None:
                    self._cond.wait()
                    pending = self._next()
            issue, pending.issue = pending.issue, None  # drop the buffers once issued (history keeps timings)
            try:
                work = issue()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                self._finish(pending, error)
                continue
            if work is None:
                self._finish(pending, None)
            else:
                work.get_future().add_done_callback(lambda future, p=pending: self._finish(p, error_of(future)))

    def _finish(self, pending: Pending, error: BaseException | None) -> None:
        pending.t_done = time.perf_counter()
        pending.error = error
        with self._cond:
            self._in_flight[pending.lane_key] = None
            if self.history is not None:
                self.history.append(pending)
            self._cond.notify_all()
        pending.done.set()


def next_lane(lanes: dict[str, deque], in_flight: dict[str, object], class_of: dict[str, str], enforce_priority: bool) -> str | None:
    """The lane whose head may go on the wire now, or None: the rule of the module doc, as
    a pure function of the queues, so `commfx simulate` replays the same decisions."""
    busy_above, level_busy, level = False, False, None
    for name in sorted(lanes, key=lambda n: PRIORITY_CLASSES[class_of[n]].level):
        if PRIORITY_CLASSES[class_of[name]].level != level:  # lanes of one class do not hold each other back
            level, busy_above = PRIORITY_CLASSES[class_of[name]].level, busy_above or level_busy
        queue, flying = lanes[name], in_flight[name]
        if queue and flying is None and not (enforce_priority and busy_above):
            return name
        level_busy = level_busy or bool(queue) or flying is not None
    return None


def error_of(future) -> BaseException | None:
    try:
        future.value()
    except BaseException as error:  # noqa: BLE001
        return error
    return None
