"""Work handles the dispatchers wait on, for operations that have no future of their own.

A dispatcher (`priority.Dispatcher`, `stream_lanes.StreamLanes`) expects what an issue
returns to have `get_future()`; gloo's point-to-point works and commfx's composite
collectives (a hierarchical all-to-all, a reduce-scatter built from an all-to-all) get one
here.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class Running:
    """A function run to completion on its own thread, with the future the dispatcher waits on."""

    def __init__(self, fn, name: str = "commfx-hierarchical-a2a"):
        self._future = torch.futures.Future()

        def run():
            try:
                fn()
                self._future.set_result(None)
            except BaseException as error:  # noqa: BLE001 - handed to the future
                self._future.set_exception(error)

        threading.Thread(target=run, name=name, daemon=True).start()

    def get_future(self):
        return self._future


def work_in_thread(work, timeout_s: float) -> Running:
    """gloo's point-to-point works have no future: wait for one on a helper thread so the
    dispatcher (which expects `get_future()`) never blocks on a peer."""
    return Running(lambda: work.wait(timedelta(seconds=timeout_s)), name="commfx-p2p")


class Then:
    """A work whose future completes once `fn` has run on the work's result."""

    def __init__(self, work, fn):
        def then(future):
            future.value()  # re-raises the collective's error
            fn()

        self._future = work.get_future().then(then)

    def get_future(self):
        return self._future


def reduce_scatter_by_all_to_all(out: torch.Tensor, x: torch.Tensor, pg) -> Then:
    """A reduce-scatter as an all-to-all of the shards, summed here in rank order: each rank
    sends (P-1)/P of `x`, as a ring reduce-scatter does (gloo's own sends an all-reduce's)."""
    received = torch.empty_like(x)
    work = dist.all_to_all_single(received, x.contiguous(), group=pg, async_op=True)
    return Then(work, lambda: torch.sum(received.view(-1, out.numel()), dim=0, out=out))
