"""Gradient buckets cut into per-rank shards (the shard_states pass, ZeRO stages 1 to 3).

Every gradient bucket (`commfx.buckets`) is a flat buffer of its parameters, in bucket
order, padded to a multiple of its group's size P and cut into P equal contiguous shards;
this rank holds shard `index` of each (`BucketShard`). Stage 1 reduces gradients as
`GradientSync` does (all-reduce) and only the optimizer is sharded; stage 2 reduce-scatters
each bucket instead, so backward leaves this rank its shard of each reduced gradient
(`BucketShard.grad`, summed over backward passes until `clear_grads`) and hands autograd
no gradient for those parameters: the sharded optimizer (`sharded_optimizer.py`) steps from
the shards. Stage 3 reduces as stage 2 and shards the parameters too (`param_gather.py`). A reduce-scatter is one collective per bucket in the gradient class (not cut
into chunks, whose shards would not line up). Deferring is not supported (the pass refuses
defer_grad_sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..buckets import owned, shard_size
from .comm import CommScheduler
from .grad_sync import Bucket, GradientSync, Slot
from .param_gather import ParamGather


@dataclass(eq=False)
class BucketShard:
    """This rank's shard of one bucket: [begin, end) of its padded flat buffer."""

    bucket: Bucket
    parts: int  # ranks of the bucket's group
    index: int  # this rank's place in it
    starts: dict[int, int]  # slot -> where its parameter starts in the flat buffer
    numel: int  # unpadded elements of the bucket
    grad: torch.Tensor | None = None  # stage 2: this rank's shard of the reduced gradient
    had_grad: set[int] = field(default_factory=set)  # slots that produced a gradient since clear_grads
    full: torch.Tensor | None = None  # stage 3: the flat parameters, whose storage the parameters view (freed between uses)
    params: torch.Tensor | None = None  # stage 3: this rank's shard of them, what the optimizer steps

    @property
    def size(self) -> int:
        return shard_size(self.numel, self.parts)

    @property
    def range(self) -> tuple[int, int]:
        return self.index * self.size, (self.index + 1) * self.size

    def owned(self, slot: int, numel: int) -> tuple[int, int]:
        """[lo, hi) of slot's flattened parameter that this rank holds."""
        return owned(self.starts[slot], numel, self.range)


class ShardedGradSync(GradientSync):
    """`GradientSync` whose buckets are sharded (`shards`); stage 2 reduce-scatters them."""

    def __init__(self, slots: list[Slot], scheduler: CommScheduler, *, stage: int, **options):
        super().__init__(slots, scheduler, **options)
        self.stage = stage
        self.shards: list[BucketShard] = []
        for bucket in self.buckets:
            handle = scheduler.group(bucket.group)
            starts, offset = {}, 0
            for slot in bucket.slots:
                starts[slot] = offset
                offset += slots[slot].param.numel()
            self.shards.append(BucketShard(bucket, handle.size, handle.rank, starts, offset))
        self.optimizer_attached = False
        # stage 3: parameters sharded too, gathered around each use (param_gather.py)
        self.params = ParamGather(self.shards, [s.param for s in slots], scheduler) if stage >= 3 else None

    def ready(self, slot: int, grad: torch.Tensor | None) -> None:
        if self.stage >= 2 and not self.optimizer_attached:  # before anything is issued: every rank stops alike
            raise RuntimeError(
                "shard_states:stage=2 keeps only this rank's shard of each gradient, for its sharded optimizer; make that "
                "optimizer before the first backward: optimizer = commfx.shard_optimizer(dm, torch.optim.AdamW, lr=...)"
            )
        super().ready(slot, grad)

    def _issue(self, bucket: Bucket) -> None:
        if self.stage < 2:
            return super()._issue(bucket)
        shard = self.shards[bucket.index]
        pieces = []
        for slot in bucket.slots:
            grad = bucket.grads.get(slot)
            pieces.append(grad.reshape(-1) if grad is not None else self.slots[slot].param.new_zeros(self.slots[slot].param.numel()))
        pad = shard.size * shard.parts - shard.numel
        if pad:
            pieces.append(pieces[0].new_zeros(pad))
        flat = torch.cat(pieces)
        bucket.flat = flat.new_empty(shard.size)
        tag = f"bucket {bucket.index} shard {shard.index + 1}/{shard.parts}"
        priority = bucket.priority or self.priority
        bucket.pending = [self.scheduler.start_sharded("reduce_scatter", bucket.flat, flat, bucket.group, "grad_reduce_scatter", priority, tag)]

    def finish(self) -> dict[int, torch.Tensor | None]:
        if self.stage < 2:
            return super().finish()
        self.queue_rest()
        reduced: dict[int, torch.Tensor | None] = {}
        try:
            for bucket in self.buckets:
                for pending in bucket.pending:
                    self.scheduler.wait(pending)
                shard = self.shards[bucket.index]
                scale = self.scales.get(bucket.group, self.scale)
                if scale != 1.0:
                    bucket.flat.mul_(scale)
                shard.grad = bucket.flat if shard.grad is None else shard.grad.add_(bucket.flat)
                shard.had_grad.update(bucket.grads)
                reduced.update((slot, None) for slot in bucket.grads)  # autograd gets none: the shard holds it
        finally:
            self.reset_buckets()
        return reduced

    def clear_grads(self) -> None:
        for shard in self.shards:
            shard.grad = None
            shard.had_grad.clear()
