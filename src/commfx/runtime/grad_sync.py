"""Gradient synchronisation during backward: bucketed, chunked, low-priority all-reduce.

Each parameter's gradient is summed over the ranks that hold a replica of it: the whole
world for replicated (data-parallel) parameters, the `edp` group for expert shards (a
group of one when ep == world, so no traffic). With `mean` reduction every gradient is
then divided by the world size, which matches DDP: the global-batch gradient of the mean
of per-rank losses.

The backward executor hands each gradient over the moment the backward graph produces it
(`ready`). Buckets fill in reverse parameter order (roughly the order backward produces
gradients); a bucket is flattened and queued as soon as it and every bucket before it are
complete, in `chunk_bytes` pieces of the `grad` priority class, so the all-reduce runs
while backward goes on and an all-to-all can overtake it between pieces. Buckets and
pieces are queued strictly in index order, which is the same on every rank: that keeps
each group's collective order identical everywhere. A bucket over a group of one rank sends
nothing, so it holds no later bucket back. `finish` (end of backward) queues
what is left, with zeros for gradients this step did not produce, waits, and returns the
reduced gradients.

With `defer` on (the defer_grad_sync pass, once an optimizer is attached), `finish` does not
wait: buckets still on the wire become `InFlight` and their slots come back as None (no
gradient yet); `settle` waits for them later and returns their reduced gradients, which
`deferred_step.DeferredStep` applies. A bucket over a group of one rank (nothing to wait
for) is never deferred.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..buckets import Entry, make_buckets
from .comm import CommScheduler
from .priority import Pending

# defer_grad_sync: buckets whose parameters the forward uses in its first half go in the
# `grad_next` class, ahead of the others. Backward produces them last, and the next forward
# would otherwise wait for them behind every other bucket of the FIFO.
NEXT_PRIORITY = "grad_next"
URGENT_SHARE = 0.5
WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: the gradients' own dtype


@dataclass
class Slot:
    """One gradient the backward graph returns: its parameter and the group that reduces it.
    `group=None`: the graph reduced it already (a pass exchanged it, e.g. sparse embedding
    rows); the sync passes it through untouched."""

    name: str
    param: torch.Tensor
    group: str | None


@dataclass
class Bucket:
    index: int
    group: str
    slots: list[int]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    priority: str = ""  # "" : the sync's class
    flat: torch.Tensor | None = None
    pending: list[Pending | None] = field(default_factory=list)

    def complete(self) -> bool:
        return len(self.grads) == len(self.slots)


@dataclass(eq=False)
class InFlight:
    """A bucket of an earlier backward whose all-reduce may still be running."""

    group: str
    offsets: dict[int, int]  # slot that had a gradient -> where it starts in `flat`
    flat: torch.Tensor
    pending: list[Pending | None]


class GradientSync:
    def __init__(
        self,
        slots: list[Slot],
        scheduler: CommScheduler,
        *,
        scale: float,
        scales: dict[str, float] | None = None,  # per group, where it differs from `scale`
        bucket_bytes: int = 1 << 20,
        chunk_bytes: int = 0,  # 0: a bucket is one collective
        priority: str = "grad",
        reduce_dtype: str = "fp32",  # the dtype on the wire (Plan.grad_reduce_dtype)
    ):
        self.slots = slots
        self.scheduler = scheduler
        self.scale = scale
        self.scales = scales or {}
        self.chunk_bytes = chunk_bytes
        self.priority = priority
        self.wire_dtype = WIRE_DTYPES[reduce_dtype]
        self.buckets = _make_buckets(slots, bucket_bytes)
        self._bucket_of = {slot: bucket for bucket in self.buckets for slot in bucket.slots}
        self._next = 0
        self._issued: set[int] = set()  # bucket indices queued this backward
        self._sends: dict[str, bool] = {}  # group -> whether it has more than one rank
        self.defer = False
        self.in_flight: dict[int, InFlight] = {}  # slot -> its deferred bucket

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def ready(self, slot: int, grad: torch.Tensor | None) -> None:
        bucket = self._bucket_of.get(slot)
        if bucket is None or grad is None:
            return
        bucket.grads[slot] = grad
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.complete():
                self._queue(bucket)
            elif self.communicates(bucket):
                break  # a collective: the next one in every rank's order
            self._next += 1  # a one-rank bucket sends nothing, so later buckets need not wait for it

    def queue_rest(self) -> None:
        """Queue every bucket not queued yet (the end of backward), in index order."""
        for bucket in self.buckets:
            if bucket.index not in self._issued:
                self._queue(bucket)

    def _queue(self, bucket: Bucket) -> None:
        self._issued.add(bucket.index)
        self._issue(bucket)

    def communicates(self, bucket: Bucket) -> bool:
        """Whether `bucket`'s all-reduce sends anything (its group has more than one rank)."""
        if bucket.group not in self._sends:
            self._sends[bucket.group] = self.scheduler.group(bucket.group).size > 1
        return self._sends[bucket.group]

    @property
    def communicating_buckets(self) -> list[Bucket]:
        return [b for b in self.buckets if self.communicates(b)]

    def finish(self) -> dict[int, torch.Tensor | None]:
        """Queue the rest, wait for every bucket, and return slot -> reduced gradient (None:
        deferred, see `settle`)."""
        self.queue_rest()
        reduced: dict[int, torch.Tensor | None] = {}
        try:
            for bucket in self.buckets:
                offsets, offset = {}, 0
                for slot in bucket.slots:
                    if slot in bucket.grads:
                        offsets[slot] = offset
                    offset += self.slots[slot].param.numel()
                flight = InFlight(bucket.group, offsets, bucket.flat, bucket.pending)
                if self.defer and any(p is not None for p in bucket.pending):
                    for slot in offsets:
                        self.in_flight[slot] = flight
                        reduced[slot] = None
                else:
                    reduced.update(self._reduced(flight))
        finally:
            self.reset_buckets()
        return reduced

    def reset_buckets(self) -> None:
        """Every bucket empty again and the next one to fill the first: the end of a backward."""
        for bucket in self.buckets:
            bucket.grads.clear()
            bucket.pending = []
            bucket.flat = None
        self._next = 0
        self._issued.clear()

    @property
    def pending(self) -> bool:
        return bool(self.in_flight)

    def order_for_forward(self, position: dict[int, float]) -> None:
        """slot -> where the forward first uses it (0..1): urgent buckets get the `grad_next`
        class. Called with the forward graph, the same on every rank, before any backward."""
        for bucket in self.buckets:
            first = min((position[s] for s in bucket.slots if s in position), default=1.0)
            bucket.priority = NEXT_PRIORITY if first < URGENT_SHARE else ""

    def settle(self, slots=None) -> dict[int, torch.Tensor]:
        """Wait for the deferred buckets holding `slots` (all of them by default) and return
        slot -> reduced gradient for every slot of those buckets."""
        wanted = list(self.in_flight) if slots is None else [s for s in slots if s in self.in_flight]
        reduced: dict[int, torch.Tensor] = {}
        for slot in wanted:
            flight = self.in_flight.get(slot)
            if flight is None:  # settled with an earlier slot of its bucket
                continue
            for member in flight.offsets:
                del self.in_flight[member]
            reduced.update(self._reduced(flight))
        return reduced

    def _reduced(self, flight: InFlight) -> dict[int, torch.Tensor]:
        for pending in flight.pending:
            self.scheduler.wait(pending)
        some = self.slots[next(iter(flight.offsets))].param if flight.offsets else None
        if some is not None and flight.flat.dtype != some.dtype:  # reduced in the wire dtype: back to the parameters'
            flight.flat = flight.flat.to(some.dtype)
        scale = self.scales.get(flight.group, self.scale)
        if scale != 1.0:
            flight.flat.mul_(scale)
        return {
            slot: flight.flat[offset : offset + self.slots[slot].param.numel()].view(self.slots[slot].param.shape)
            for slot, offset in flight.offsets.items()
        }

    def _issue(self, bucket: Bucket) -> None:
        pieces = []
        for slot in bucket.slots:
            grad = bucket.grads.get(slot)
            pieces.append(grad.reshape(-1) if grad is not None else torch.zeros_like(self.slots[slot].param).reshape(-1))
        bucket.flat = torch.cat(pieces)
        if self.wire_dtype is not None and bucket.flat.is_floating_point():
            bucket.flat = bucket.flat.to(self.wire_dtype)
        element = bucket.flat.element_size()
        step = max(1, self.chunk_bytes // element) if self.chunk_bytes else bucket.flat.numel()
        chunks = bucket.flat.split(step)
        for i, chunk in enumerate(chunks):
            tag = f"bucket {bucket.index} chunk {i + 1}/{len(chunks)}"
            bucket.pending.append(
                self.scheduler.start_all_reduce(chunk, bucket.group, kind="grad_all_reduce", priority=bucket.priority or self.priority, tag=tag)
            )


def _make_buckets(slots: list[Slot], bucket_bytes: int) -> list[Bucket]:
    entries = [
        Entry(slot.group if slot.param.requires_grad else None, slot.param.dtype, slot.param.numel(), slot.param.element_size())
        for slot in slots
    ]
    return [Bucket(i, group, indices) for i, (group, indices) in enumerate(make_buckets(entries, bucket_bytes))]
