"""Gradient buckets: a bucket over one rank sends nothing and holds no collective back."""

from types import SimpleNamespace

import torch

from commfx.runtime.grad_sync import GradientSync, Slot


class _Recorder:
    """A scheduler stand-in: group sizes, and the all-reduces queued (by group), in order."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.queued: list[str] = []

    def group(self, name, priority=None):
        return SimpleNamespace(size=self.sizes[name])

    def start_all_reduce(self, tensor, group, kind="all_reduce", priority="", tag=""):
        self.queued.append(group)
        return None

    def wait(self, pending):
        pass


def _sync(sizes):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 4)]
    slots = [Slot("layer", params[0], "dp"), Slot("layer2", params[1], "dp"), Slot("head_shard", params[2], "ep")]
    recorder = _Recorder(sizes)
    return GradientSync(slots, recorder, scale=1.0, bucket_bytes=4), recorder  # one parameter a bucket


def test_a_late_one_rank_bucket_does_not_hold_the_all_reduce_back():
    sync, recorder = _sync({"dp": 2, "ep": 1})
    assert [b.group for b in sync.buckets] == ["ep", "dp", "dp"]  # reverse parameter order: the head's first
    sync.ready(1, torch.ones(2))
    sync.ready(0, torch.ones(3))
    assert recorder.queued == ["dp", "dp"]  # both all-reduces started before the head's gradient exists
    sync.ready(2, torch.ones(4))
    reduced = sync.finish()
    assert recorder.queued == ["dp", "dp", "ep"]
    assert torch.equal(reduced[2], torch.ones(4)) and torch.equal(reduced[0], torch.ones(3))


def test_a_late_bucket_that_communicates_still_holds_the_order():
    sync, recorder = _sync({"dp": 2, "ep": 2})
    sync.ready(1, torch.ones(2))
    sync.ready(0, torch.ones(3))
    assert recorder.queued == []  # bucket 0 (ep) is a collective every rank queues first
    sync.ready(2, torch.ones(4))
    assert recorder.queued == ["ep", "dp", "dp"]
    sync.finish()
