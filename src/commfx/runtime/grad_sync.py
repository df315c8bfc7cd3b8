"""Gradient synchronisation during backward: bucketed all-reduce of replicated gradients.

Each parameter's gradient is summed over the ranks that hold a replica of it: the whole
world for replicated (data-parallel) parameters, the `edp` group for expert shards (a
group of one when ep == world, so no traffic). With `mean` reduction every gradient is
then divided by the world size, which matches DDP: the global-batch gradient of the mean
of per-rank losses.

Buckets fill in reverse registration order (roughly the order backward produces
gradients) and a bucket is issued as soon as it and every bucket before it are ready, so
reduction overlaps the rest of backward. Buckets are issued strictly in index order,
which is the same on every rank: that is what keeps each group's collective order
identical everywhere. At the end of backward any bucket still waiting (a parameter that
got no gradient this step) is issued with zeros for the missing gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import CommScheduler


@dataclass
class Bucket:
    group: str
    params: list[torch.nn.Parameter]
    ready: set[int] = field(default_factory=set)

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class GradientSync:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        group_of: dict[str, str],
        scheduler: CommScheduler,
        *,
        scale: float,
        bucket_bytes: int = 4 * 2**20,
    ):
        self.scheduler = scheduler
        self.scale = scale
        self.buckets = _make_buckets(named_params, group_of, bucket_bytes)
        self._bucket_of = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._next = 0
        self._armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_ready) for _, p in named_params]

    def _on_ready(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        i, j = self._bucket_of[id(param)]
        self.buckets[i].ready.add(j)
        while self._next < len(self.buckets) and self.buckets[self._next].complete():
            self._reduce(self.buckets[self._next])
            self._next += 1

    def _finish(self) -> None:
        for bucket in self.buckets[self._next :]:
            self._reduce(bucket)
        for bucket in self.buckets:
            bucket.ready.clear()
        self._next = 0
        self._armed = False

    def _reduce(self, bucket: Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.scheduler.all_reduce(flat, bucket.group, kind="grad_all_reduce")
        if self.scale != 1.0:
            flat.mul_(self.scale)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _make_buckets(named_params, group_of, bucket_bytes) -> list[Bucket]:
    buckets: list[Bucket] = []
    sizes: list[int] = []
    for name, param in reversed(named_params):
        group = group_of[name]
        nbytes = param.numel() * param.element_size()
        if buckets and buckets[-1].group == group and sizes[-1] + nbytes <= bucket_bytes:
            buckets[-1].params.append(param)
            sizes[-1] += nbytes
        else:
            buckets.append(Bucket(group, [param]))
            sizes.append(nbytes)
    return buckets
