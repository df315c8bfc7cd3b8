"""The priority dispatcher: FIFO lanes, pre-emption between chunks, errors and time bounds."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from commfx.runtime.comm import CommError, local_scheduler
from commfx.plan import priority_class, register_priority_class
from commfx.runtime.priority import Dispatcher, Pending


class FakeWork:
    """A c10d Work stand-in the test completes by hand."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def complete(self, error: Exception | None = None):
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)


class Wire:
    """Records the order collectives are issued in; each returns a FakeWork."""

    def __init__(self):
        self.issued: list[str] = []
        self.works: dict[str, FakeWork] = {}
        self.changed = threading.Event()

    def collective(self, name: str, priority: str) -> Pending:
        def issue():
            self.works[name] = FakeWork()
            self.issued.append(name)
            self.changed.set()
            return self.works[name]

        return Pending("test", priority, "world", name, 0, issue)

    def wait_issued(self, count: int, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.issued) < count and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)  # let the dispatcher issue anything else it (wrongly) would
        return list(self.issued)


def test_a_lane_issues_one_collective_at_a_time_in_submission_order():
    dispatcher, wire = Dispatcher(), Wire()
    items = [dispatcher.submit(wire.collective(f"a{i}", "a2a")) for i in range(3)]
    assert wire.wait_issued(1) == ["a0"]
    wire.works["a0"].complete()
    assert wire.wait_issued(2) == ["a0", "a1"]
    wire.works["a1"].complete()
    wire.works[wire.wait_issued(3)[-1]].complete()
    for item in items:
        assert item.done.wait(5)
    assert wire.issued == ["a0", "a1", "a2"]


def test_all_to_all_pre_empts_gradient_chunks_between_chunks():
    dispatcher, wire = Dispatcher(enforce_priority=True), Wire()
    grads = [dispatcher.submit(wire.collective(f"g{i}", "grad")) for i in range(3)]
    assert wire.wait_issued(1) == ["g0"]  # the low lane runs while nothing is above it
    a2a = dispatcher.submit(wire.collective("a0", "a2a"))
    # the all-to-all goes on the wire at once, next to the chunk already there (not interrupted)
    assert wire.wait_issued(2) == ["g0", "a0"]
    wire.works["g0"].complete()
    assert wire.wait_issued(3, timeout=0.1) == ["g0", "a0"], "a gradient chunk went out while an all-to-all was in flight"
    wire.works["a0"].complete()
    assert a2a.done.wait(5)
    assert wire.wait_issued(3) == ["g0", "a0", "g1"]
    wire.works["g1"].complete()
    wire.works[wire.wait_issued(4)[-1]].complete()
    assert all(g.done.wait(5) for g in grads)


def test_without_priority_lanes_run_side_by_side():
    dispatcher, wire = Dispatcher(enforce_priority=False), Wire()
    dispatcher.submit(wire.collective("a0", "a2a"))
    dispatcher.submit(wire.collective("g0", "grad"))
    assert sorted(wire.wait_issued(2)) == ["a0", "g0"]


def test_a_queued_low_chunk_waits_for_every_queued_high_collective():
    dispatcher, wire = Dispatcher(), Wire()
    dispatcher.submit(wire.collective("a0", "a2a"))
    dispatcher.submit(wire.collective("a1", "a2a"))
    dispatcher.submit(wire.collective("g0", "grad"))
    assert wire.wait_issued(1) == ["a0"]
    wire.works["a0"].complete()
    assert wire.wait_issued(2) == ["a0", "a1"]  # not g0: a1 was still queued
    wire.works["a1"].complete()
    assert wire.wait_issued(3) == ["a0", "a1", "g0"]
    wire.works["g0"].complete()


def test_failures_reach_the_waiting_thread_with_the_collective_named():
    scheduler = local_scheduler()
    wire = Wire()
    pending = scheduler.dispatcher.submit(wire.collective("a0", "a2a"))
    wire.wait_issued(1)
    wire.works["a0"].complete(RuntimeError("connection reset by peer"))
    with pytest.raises(CommError, match="connection reset by peer"):
        scheduler.wait(pending)


def test_a_collective_that_never_finishes_times_out_with_a_clear_error():
    scheduler = local_scheduler()
    scheduler.timeout_s = 0.2
    wire = Wire()
    pending = scheduler.dispatcher.submit(wire.collective("a0", "a2a"))
    with pytest.raises(CommError, match="did not finish within"):
        scheduler.wait(pending)
    wire.works["a0"].complete()


def test_issue_errors_and_unknown_classes_are_reported():
    dispatcher = Dispatcher()

    def broken():
        raise RuntimeError("bad split sizes")

    pending = dispatcher.submit(Pending("test", "a2a", "world", "", 0, broken))
    assert pending.done.wait(5) and "bad split sizes" in str(pending.error)
    with pytest.raises(ValueError, match="unknown priority class"):
        dispatcher.submit(Pending("test", "nope", "world", "", 0, broken))
    with pytest.raises(ValueError, match="already registered"):
        register_priority_class("grad", 1, "clash")
    assert priority_class("a2a").level < priority_class("grad").level


def test_local_scheduler_has_groups_for_every_class():
    scheduler = local_scheduler()
    x = torch.arange(6.0).view(3, 2)
    out = scheduler.all_to_all(x, [3], [3], "ep", priority="a2a")
    assert torch.equal(out, x)
    assert scheduler.group("world", "grad").name == "grad/world"
    with pytest.raises(CommError, match="not in the plan"):
        scheduler.group("pp_ends")  # only a pipeline has it


def test_a_class_registered_after_the_groups_were_built_is_refused_with_the_fix():
    from commfx.plan import PRIORITY_CLASSES

    scheduler = local_scheduler()
    register_priority_class("late-test-class", 50, "registered after the scheduler was built")
    try:
        with pytest.raises(CommError, match="has no process groups of its own; register it"):
            scheduler.group("world", "late-test-class")
    finally:
        del PRIORITY_CLASSES["late-test-class"]
