"""The CUDA dispatcher's logic (runtime/stream_lanes.py), on the CPU with stand-in works.

What a GPU adds (NCCL streams, a wait that orders the device) is in test_cuda_path.py; here:
issue order, where a wait goes, and how failures reach the caller.
"""

from __future__ import annotations

import threading

import pytest

from commfx.plan import PRIORITY_CLASSES, Topology
from commfx.runtime.comm import CommError, CommScheduler
from commfx.runtime.priority import Pending
from commfx.runtime.stream_lanes import StreamLanes, lane_group_options
from commfx.runtime.works import Running


class FakeWork:
    """A c10d work stand-in: records its waits; `error` is raised by wait, as NCCL's abort is."""

    def __init__(self, log: list, name: str, error: BaseException | None = None):
        self.log, self.name, self.error = log, name, error

    def wait(self, timeout=None):
        self.log.append(f"wait {self.name}")
        if self.error is not None:
            raise self.error
        return True


def collective(log: list, name: str, priority: str = "a2a", error: BaseException | None = None) -> Pending:
    def issue():
        log.append(f"issue {name}")
        return FakeWork(log, name, error)

    return Pending("all_reduce", priority, "world", name, 8, issue)


def test_issues_at_once_in_submission_order_and_waits_on_the_work():
    log, lanes = [], StreamLanes()
    lanes.history = []
    low = lanes.submit(collective(log, "g0", "grad"))
    high = lanes.submit(collective(log, "a0", "a2a"))
    assert log == ["issue g0", "issue a0"]  # nothing held back on the host: the GPU's stream priorities order them
    assert low.done.is_set() and high.done.is_set() and high.work is not None
    assert lanes.wait(high, timeout_s=1.0) and log[-1] == "wait a0"
    assert high.work is None  # waited once: a second wait orders nothing again
    assert lanes.wait(high, timeout_s=1.0) and log.count("wait a0") == 1
    assert [p.tag for p in lanes.history] == ["g0", "a0"]


def test_scheduler_on_cuda_uses_stream_lanes_and_raises_failures_once_waited():
    scheduler = CommScheduler(Topology(world_size=1), 0, {}, timeout_s=5.0, device_type="cuda")
    assert isinstance(scheduler.dispatcher, StreamLanes) and scheduler.dispatcher.device_ordered
    log = []
    aborted = scheduler.dispatcher.submit(collective(log, "a0", error=RuntimeError("NCCL watchdog: communicator aborted")))
    with pytest.raises(CommError, match="communicator aborted"):
        scheduler.wait(aborted)

    def refuse():
        raise RuntimeError("invalid device pointer")

    refused = scheduler.dispatcher.submit(Pending("all_to_all", "a2a", "ep", "x", 8, refuse))
    with pytest.raises(CommError, match="invalid device pointer"):
        scheduler.wait(refused)
    with pytest.raises(ValueError, match="unknown priority class"):
        scheduler.dispatcher.submit(Pending("all_to_all", "nope", "ep", "x", 8, refuse))


def test_host_side_composites_are_waited_through_their_future_with_a_bound():
    lanes, release = StreamLanes(), threading.Event()
    pending = lanes.submit(Pending("all_to_all", "a2a", "ep", "h", 8, lambda: Running(release.wait)))
    assert pending.work is None and not lanes.wait(pending, timeout_s=0.05)  # still running: the bound holds
    release.set()
    assert lanes.wait(pending, timeout_s=5.0) and pending.error is None


def test_cpu_scheduler_keeps_the_dispatcher_thread():
    scheduler = CommScheduler(Topology(world_size=1), 0, {}, device_type="cpu")
    assert not scheduler.dispatcher.device_ordered


def test_only_classes_that_block_compute_get_stream_options_on_cuda():
    assert lane_group_options("cpu", "a2a") is None
    assert lane_group_options("cuda", "grad") is None and lane_group_options("cuda", "grad_next") is None  # gradients overlap compute
    assert not PRIORITY_CLASSES["a2a"].overlaps_compute and not PRIORITY_CLASSES["pp"].overlaps_compute
