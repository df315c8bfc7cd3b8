"""Priority lanes on a GPU: NCCL streams with stream priorities, ordered by work handles.

On CUDA the dispatcher thread of `priority.py` is the wrong tool. A collective issued on
NCCL is queued on its process group's own CUDA stream, after the work already queued on
the issuing stream, and `work.wait()` makes the *current stream* wait for it without
blocking the host. So on CUDA:

- each lane is a process group (`build_groups` makes one set per priority class), and the
  class becomes its stream's priority: classes that block compute (all-to-all, control,
  pipeline) get high-priority NCCL streams, gradient classes normal ones
  (`lane_group_options`), so the GPU's block scheduler runs an all-to-all's kernels ahead
  of a gradient chunk's whenever both have work queued;
- `submit` issues at once, on the caller's thread, in submission order: the order every
  rank shares (graph order, bucket order), as on the CPU path. Nothing is held back on the
  host: pre-emption between lanes is the GPU's, at block granularity;
- `wait` is `work.wait()`: the consumer's stream waits on an event of the collective's
  stream; the host goes on queueing compute.

A hung peer is bounded by the process group's timeout: NCCL's watchdog aborts the
communicator and the next wait raises (`build_groups` creates every group with
`Plan.collective_timeout_s`). Operations that have no device-side work (a thread running a
composite collective, `works.Running`) are waited on through their future, on the host.
"""

from __future__ import annotations

import threading
import time

from ..plan import PRIORITY_CLASSES, priority_class
from .priority import Pending, error_of


class StreamLanes:
    """The dispatcher of a CUDA run (see module doc); the interface of `priority.Dispatcher`."""

    device_ordered = True  # issues return c10d works whose wait orders the device, not the host

    def __init__(self, enforce_priority: bool = True):
        # Kept for the runtime's schedule flags; on a GPU the lanes' stream priorities are
        # fixed when their process groups are created (lane_group_options).
        self.enforce_priority = enforce_priority
        self.history: list[Pending] | None = None
        self._lock = threading.Lock()

    def submit(self, pending: Pending) -> Pending:
        priority_class(pending.priority)  # unknown classes fail on the caller's thread, as on the CPU path
        pending.t_submit = pending.t_issue = time.perf_counter()
        issue, pending.issue = pending.issue, None
        try:
            work = issue()
        except BaseException as error:  # noqa: BLE001 - raised at the wait, as on the CPU path
            self._finish(pending, error)
            return pending
        if work is None:
            self._finish(pending, None)
        elif hasattr(work, "wait"):  # a c10d work: issued on its stream; the wait orders the device
            pending.work = work
            self._finish(pending, None)
        else:  # a host-side composite (works.Running): done when its future is
            work.get_future().add_done_callback(lambda future, p=pending: self._finish(p, error_of(future)))
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> bool:
        """Order the current stream after `pending` (a device-side wait: the host goes on), or
        block the host on a host-side composite; False when `timeout_s` passed first."""
        if not pending.done.wait(timeout_s):
            return False
        work, pending.work = pending.work, None
        if work is not None:
            try:
                work.wait()
            except BaseException as error:  # noqa: BLE001 - NCCL's watchdog aborted the communicator
                pending.error = error
        return True

    def _finish(self, pending: Pending, error: BaseException | None) -> None:
        pending.t_done = time.perf_counter()
        pending.error = error
        if self.history is not None:
            with self._lock:
                self.history.append(pending)
        pending.done.set()


def lane_group_options(device_type: str, priority: str):
    """The options a priority class's process groups are created with: on CUDA, classes that
    block compute get high-priority NCCL streams; None elsewhere (gradient classes, gloo, or
    a torch without NCCL)."""
    if device_type != "cuda" or PRIORITY_CLASSES[priority].overlaps_compute:
        return None
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options
