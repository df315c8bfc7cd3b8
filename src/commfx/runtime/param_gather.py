"""Parameters sharded and gathered around each use (shard_states stage 3, ZeRO-3 / FSDP).

Each sharded gradient bucket (`state_shards.BucketShard`, a group of more than one rank)
also holds its parameters as one flat buffer (`full`, padded like the gradient shards)
whose storage every parameter of the bucket views; this rank keeps only its contiguous
shard of it (`BucketShard.params`, what the sharded optimizer steps). Between uses the
flat buffer's storage is freed (`untyped_storage().resize_(0)`, as FSDP2 does): the
Parameter objects, and any view of them autograd saved for backward, stay valid and see
the data again once an all-gather refills the same storage.

A graph (forward or backward) is run with a `GraphGathers`: on its first run every
bucket whose storage a graph input views is gathered up front, and the nodes that read
each bucket are recorded; from then on a bucket is all-gathered just before its first
reader, the next bucket in order of first use is issued as that one is waited for
(prefetch: its all-gather runs while this bucket computes), and a bucket is freed after
its last reader. The order is the graph's, the same on every rank, so every rank issues
the all-gathers in the same order. After an optimizer step the whole buffers are stale:
`release` frees them, and the next forward gathers the stepped shards.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..plan import DEFAULT_CLASS
from .comm import CommScheduler

if TYPE_CHECKING:
    from .state_shards import BucketShard

USES = "commfx_param_uses"  # gm.meta key: the recorded readers of each bucket


class ParamGather:
    """The stage-3 buckets of one gradient sync: their flat storages, whole or freed."""

    def __init__(self, shards: list["BucketShard"], params: list[torch.Tensor], scheduler: CommScheduler):
        self.scheduler = scheduler
        self.shards = [s for s in shards if s.parts > 1]
        placed: set[int] = set()
        for shard in self.shards:
            first = params[shard.bucket.slots[0]]
            full = first.detach().new_zeros(shard.size * shard.parts)
            for slot in shard.bucket.slots:
                param, start = params[slot], shard.starts[slot]
                full[start : start + param.numel()].copy_(param.detach().reshape(-1))
                if id(param) not in placed:  # a tied parameter views its first bucket only
                    placed.add(id(param))
                    param.data = full[start : start + param.numel()].view(param.shape)
            shard.full = full
            shard.params = full[shard.range[0] : shard.range[1]].clone()
        self.nbytes = [s.full.untyped_storage().nbytes() for s in self.shards]
        self.of_storage = {s.full.untyped_storage()._cdata: i for i, s in enumerate(self.shards)}
        self.whole = [True] * len(self.shards)
        self.pending: dict[int, object] = {}
        self.release()

    # -- one bucket ---------------------------------------------------------------------

    def start(self, index: int) -> None:
        """Issue bucket `index`'s all-gather into its storage (nothing if whole or on the way)."""
        if self.whole[index] or index in self.pending:
            return
        shard = self.shards[index]
        shard.full.untyped_storage().resize_(self.nbytes[index])
        tag = f"bucket {shard.bucket.index} params"
        self.pending[index] = self.scheduler.start_sharded("all_gather", shard.full, shard.params, shard.bucket.group, "param_all_gather", DEFAULT_CLASS, tag)

    def wait(self, index: int) -> None:
        self.start(index)
        if index in self.pending:
            self.scheduler.wait(self.pending.pop(index))
        self.whole[index] = True

    def free(self, index: int) -> None:
        if index in self.pending:  # never free under a collective that writes into it
            self.scheduler.wait(self.pending.pop(index))
        self.shards[index].full.untyped_storage().resize_(0)
        self.whole[index] = False

    # -- all buckets --------------------------------------------------------------------

    def gather_all(self) -> None:
        """Every parameter whole on this rank until the next step (a collective)."""
        for index in range(len(self.shards)):
            self.start(index)
        for index in range(len(self.shards)):
            self.wait(index)

    def release(self) -> None:
        for index in range(len(self.shards)):
            self.free(index)

    def refresh_shards(self) -> None:
        """Copy the whole parameters into this rank's shards (after a state_dict was loaded into them)."""
        for index, shard in enumerate(self.shards):
            if self.whole[index]:
                shard.params.copy_(shard.full[shard.range[0] : shard.range[1]])

    @contextlib.contextmanager
    def materialized(self):
        """Storage behind every parameter, contents undefined, no communication: for tracing
        (fake tensors read shapes only), which a rank may do on its own for a new shape."""
        freed = [i for i, whole in enumerate(self.whole) if not whole and i not in self.pending]
        for index in freed:
            self.shards[index].full.untyped_storage().resize_(self.nbytes[index])
        try:
            yield
        finally:
            for index in freed:
                self.shards[index].full.untyped_storage().resize_(0)

    def run(self, gm: fx.GraphModule, keep_last: bool = False) -> "GraphGathers":
        return GraphGathers(self, gm, keep_last)

    def bucket_of(self, value) -> int | None:
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return None
        return self.of_storage.get(value.untyped_storage()._cdata)


class GraphGathers:
    """One run of one graph: gathers each bucket before its first reader, prefetches the
    next, frees each after its last (see the module docstring). The executor calls
    `begin(args)`, `before(node, env)`, `after(node)` and `end()`. `keep_last` (the forward):
    the bucket read first in order of use last stays whole after its last reader, since the
    backward reads it first (FSDP2 keeps its root's parameters so): its all-gather would
    open the backward with nothing to hide it behind. The backward frees it after its own
    last reader; an optimizer step (`release`) in any case."""

    def __init__(self, gather: ParamGather, gm: fx.GraphModule, keep_last: bool = False):
        self.gather = gather
        self.gm = gm
        self.uses = gm.meta.get(USES)  # (order, first reader -> buckets, last reader -> buckets)
        self.kept = self.uses[0][-1] if keep_last and self.uses and self.uses[0] else None  # stays whole after this run
        self.needed: list[int] = []
        self.readers: dict[int, list[fx.Node]] = {}
        self.next = 0

    def begin(self, args) -> None:
        if self.uses is None:  # first run: gather what the inputs view, up front, and record the readers
            self.needed = sorted({b for b in map(self.gather.bucket_of, args) if b is not None})
            for index in self.needed:
                self.gather.start(index)
            for index in self.needed:
                self.gather.wait(index)
            return
        order = self.uses[0]
        if order:
            self.gather.start(order[0])

    def before(self, node: fx.Node, env: dict) -> None:
        if self.uses is None:
            if node.op != "output":
                for source in node.all_input_nodes:
                    index = self.gather.bucket_of(env.get(source))
                    if index is not None:
                        self.readers.setdefault(index, []).append(node)
            return
        order = self.uses[0]
        for index in self.uses[1].get(node, ()):
            self.gather.wait(index)
            while self.next < len(order) and (order[self.next] == index or self.gather.whole[order[self.next]]):
                self.next += 1
            if self.next < len(order):
                self.gather.start(order[self.next])  # prefetch: runs while this bucket computes

    def after(self, node: fx.Node) -> None:
        if self.uses is not None:
            for index in self.uses[2].get(node, ()):
                if index != self.kept:
                    self.gather.free(index)

    def end(self) -> None:
        if self.uses is None:
            position = {n: i for i, n in enumerate(self.gm.graph.nodes)}
            first: dict[fx.Node, list[int]] = {}
            last: dict[fx.Node, list[int]] = {}
            order = sorted(self.readers, key=lambda b: position[self.readers[b][0]])
            for index in order:
                first.setdefault(self.readers[index][0], []).append(index)
                last.setdefault(max(self.readers[index], key=position.__getitem__), []).append(index)
            self.gm.meta[USES] = (order, first, last)
            for index in self.needed:
                self.gather.free(index)
            return
        for index in self.uses[0]:  # a run that raised midway: nothing else stays whole or in flight
            if index != self.kept and (self.gather.whole[index] or index in self.gather.pending):
                self.gather.free(index)
