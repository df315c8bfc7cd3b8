"""Gradient buckets and their shards: the one rule the runtime reduces by and dumps print.

Buckets fill in reverse parameter order (roughly the order backward produces gradients),
one process group and dtype per bucket, up to `bucket_bytes` each (DDP's scheme). Under
shard_states each bucket is one flat buffer, padded to a multiple of its group's size and
cut into equal contiguous shards, shard i held by the group's rank i (DeepSpeed ZeRO's
flat partitions): a reduce-scatter leaves each rank its shard of the summed gradient, and
an all-gather of the shards rebuilds the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    """One parameter as bucketing sees it; group None: not bucketed (its gradient is not
    reduced here, or it takes none)."""

    group: str | None
    dtype: Any
    numel: int
    element_size: int


def make_buckets(entries: list[Entry], bucket_bytes: int) -> list[tuple[str, list[int]]]:
    """(group, entry indices in bucket order) per bucket, in the order they are issued."""
    buckets: list[tuple[str, list[int]]] = []
    size = 0
    for index in reversed(range(len(entries))):
        entry = entries[index]
        if entry.group is None:
            continue
        nbytes = entry.numel * entry.element_size
        last = buckets[-1] if buckets else None
        same_kind = last is not None and last[0] == entry.group and entries[last[1][0]].dtype == entry.dtype
        if same_kind and size + nbytes <= bucket_bytes:
            last[1].append(index)
            size += nbytes
        else:
            buckets.append((entry.group, [index]))
            size = nbytes
    return buckets


def shard_size(numel: int, parts: int) -> int:
    """Elements of each shard of a flat buffer of `numel` cut into `parts` (padded up)."""
    return -(-numel // parts)


def owned(start: int, numel: int, shard: tuple[int, int]) -> tuple[int, int]:
    """The part [lo, hi) of a parameter at [start, start + numel) of its bucket that falls
    in `shard` = [begin, end), relative to the parameter (lo == hi: none of it)."""
    lo = min(max(shard[0] - start, 0), numel)
    hi = max(min(shard[1] - start, numel), lo)
    return lo, hi
