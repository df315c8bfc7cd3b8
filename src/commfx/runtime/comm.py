"""The comm scheduler: the single owner of communication in a commfx process.

Every collective any commfx graph or runtime hook issues goes through one
`CommScheduler`, which (1) resolves group names to this rank's process groups, (2)
counts the bytes it sends, split into intra- and inter-node by the plan's topology, and
(3) keeps the issue order identical on every rank.

Ordering guarantee: a process group's collectives must be issued in the same order on
every rank or a real cluster hangs. Graph collectives run in graph order, and the graph
is the same on every rank; gradient buckets are issued strictly in bucket index order
(see `GradientSync`). Nothing here reorders one group's collectives per rank.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..plan import Topology


class CommError(RuntimeError):
    """A collective failed or timed out (often: another rank died)."""


@dataclass
class CommStats:
    """Exact byte counts of what this rank sent, per collective kind."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    intra_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inter_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def total_bytes(self) -> int:
        return sum(self.intra_node_bytes.values()) + sum(self.inter_node_bytes.values())

    def as_dict(self) -> dict:
        kinds = sorted(set(self.calls) | set(self.intra_node_bytes) | set(self.inter_node_bytes))
        return {
            k: {"calls": self.calls[k], "intra_node_bytes": self.intra_node_bytes[k], "inter_node_bytes": self.inter_node_bytes[k]}
            for k in kinds
        }

    def reset(self) -> None:
        self.calls.clear()
        self.intra_node_bytes.clear()
        self.inter_node_bytes.clear()


@dataclass(frozen=True)
class CollectiveRecord:
    """One issued collective, enough to replay it with dummy buffers of the same sizes."""

    kind: str
    group: str
    send_rows: tuple[int, ...]  # all_to_all: rows per peer; all_reduce: (numel,)
    recv_rows: tuple[int, ...]
    row_shape: tuple[int, ...]
    dtype: torch.dtype


class CommScheduler:
    """Issues collectives on named groups and accounts for their bytes.

    `local_only=True` replaces every collective by a local copy of the same size (the
    compute-only baseline of `commfx bench`); `records`, when a list, receives a
    CollectiveRecord per collective (to replay communication alone).
    """

    def __init__(self, topology: Topology, rank: int, groups: dict[str, "GroupHandle"]):
        self.topology = topology
        self.rank = rank
        self.groups = groups
        self.stats = CommStats()
        self.local_only = False
        self.records: list[CollectiveRecord] | None = None

    def group(self, name: str) -> "GroupHandle":
        try:
            return self.groups[name]
        except KeyError:
            raise CommError(f"process group {name!r} is not in the plan (known: {', '.join(sorted(self.groups))})") from None

    # -- collectives -------------------------------------------------------------------

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: str) -> torch.Tensor:
        handle = self.group(group)
        if len(send_rows) != handle.size or len(recv_rows) != handle.size:
            raise CommError(f"all_to_all on {group!r} needs {handle.size} splits, got {len(send_rows)}/{len(recv_rows)}")
        row_bytes = _row_bytes(x)
        self._count("all_to_all", handle, {handle.ranks[i]: n * row_bytes for i, n in enumerate(send_rows)})
        if self.records is not None:
            self.records.append(CollectiveRecord("all_to_all", group, tuple(send_rows), tuple(recv_rows), tuple(x.shape[1:]), x.dtype))
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        if self.local_only:
            # Same bytes moved, no network: keep what fits, zeros for the rest.
            out.zero_()[: min(out.shape[0], x.shape[0])].copy_(x[: out.shape[0]])
            return out
        if handle.size == 1:
            out.copy_(x)
            return out
        self._run(
            "all_to_all",
            group,
            lambda: dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=handle.pg),
        )
        return out

    def all_reduce(self, tensor: torch.Tensor, group: str, kind: str = "all_reduce") -> torch.Tensor:
        """Sum `tensor` in place over `group`."""
        handle = self.group(group)
        if handle.size == 1:
            return tensor
        # A ring all-reduce sends 2 (P-1)/P of the buffer to the next rank of the ring.
        payload = tensor.numel() * tensor.element_size()
        successor = handle.ranks[(handle.rank + 1) % handle.size]
        self._count(kind, handle, {successor: 2 * (handle.size - 1) * payload // handle.size})
        if self.records is not None:
            self.records.append(CollectiveRecord(kind, group, (tensor.numel(),), (tensor.numel(),), (), tensor.dtype))
        if self.local_only:
            return tensor  # a local "reduction" over one replica leaves the tensor as it is
        self._run(kind, group, lambda: dist.all_reduce(tensor, group=handle.pg))
        return tensor

    def all_gather_object(self, obj, group: str = "world") -> list:
        handle = self.group(group)
        out = [None] * handle.size
        self._run("all_gather_object", group, lambda: dist.all_gather_object(out, obj, group=handle.pg))
        return out

    def barrier(self, group: str = "world") -> None:
        handle = self.group(group)
        self._run("barrier", group, lambda: dist.barrier(group=handle.pg))

    # -- bookkeeping -------------------------------------------------------------------

    def _count(self, kind: str, handle: "GroupHandle", bytes_to_rank: dict[int, int]) -> None:
        self.stats.calls[kind] += 1
        my_node = self.topology.node_of(self.rank)
        for peer, nbytes in bytes_to_rank.items():
            if peer == self.rank:
                continue
            same_node = self.topology.node_of(peer) == my_node
            (self.stats.intra_node_bytes if same_node else self.stats.inter_node_bytes)[kind] += nbytes

    def _run(self, kind: str, group: str, fn) -> None:
        try:
            fn()
        except (RuntimeError, dist.DistBackendError) as error:  # gloo raises RuntimeError subclasses
            raise CommError(
                f"{kind} on group {group!r} failed on rank {self.rank}: {error}. "
                "Another rank probably died or timed out; check its log."
            ) from error


def _row_bytes(x: torch.Tensor) -> int:
    per_row = 1
    for size in x.shape[1:]:
        per_row *= size
    return per_row * x.element_size()


@dataclass
class GroupHandle:
    """This rank's view of one named group."""

    name: str
    pg: object  # a ProcessGroup, or None for a group of one
    ranks: list[int]
    rank: int  # this rank's index in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)


def build_groups(topology: Topology, rank: int) -> dict[str, GroupHandle]:
    """Create every process group of the plan (collectively: all ranks call this in order)."""
    handles: dict[str, GroupHandle] = {}
    world = list(range(topology.world_size))
    for name, rank_lists in topology.process_groups().items():
        for ranks in rank_lists:
            if ranks == world and len(ranks) > 1:
                pg = dist.group.WORLD
            elif len(ranks) > 1:
                pg = dist.new_group(ranks)  # collective over the world: every rank creates every group
            else:
                pg = None
            if rank in ranks:
                handles[name] = GroupHandle(name, pg, ranks, ranks.index(rank))
    return handles


def local_scheduler(topology: Topology | None = None) -> CommScheduler:
    """A scheduler for a world of one (the single-process reference and dumps)."""
    topology = topology or Topology(world_size=1)
    groups = {name: GroupHandle(name, None, [0], 0) for name in ("world", "ep", "edp")}
    return CommScheduler(topology, 0, groups)


# A process-wide stack rather than a contextvar: autograd may run backward ops on another
# thread, and they must find the same scheduler as the forward.
# Backward ops run after the forward's block has closed: they fall back to the process
# default, which the runtime installs when it builds a distributed module.
_ACTIVE: list[CommScheduler] = []
_PROCESS_DEFAULT: list[CommScheduler] = []


def install_default(scheduler: CommScheduler) -> None:
    _PROCESS_DEFAULT[:] = [scheduler]


def current_scheduler() -> CommScheduler:
    scheduler = _ACTIVE[-1] if _ACTIVE else (_PROCESS_DEFAULT[0] if _PROCESS_DEFAULT else None)
    if scheduler is None:
        raise CommError(
            "a commfx communication op ran outside a commfx runtime; run the graph through "
            "commfx.distribute(...) or the commfx backend, which install a comm scheduler"
        )
    return scheduler


@contextlib.contextmanager
def active(scheduler: CommScheduler):
    """Make `scheduler` the one comm ops use inside this block."""
    _ACTIVE.append(scheduler)
    try:
        yield scheduler
    finally:
        _ACTIVE.remove(scheduler)
