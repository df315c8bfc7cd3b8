"""The comm scheduler: the single owner of communication in a commfx process.

Every collective any commfx graph or runtime hook issues goes through one
`CommScheduler`, which (1) resolves group names to this rank's process groups, (2)
counts the bytes it sends, split into intra- and inter-node by the plan's topology, and
(3) keeps the issue order identical on every rank.

Ordering guarantee: a process group's collectives must be issued in the same order on
every rank or a real cluster hangs. Graph collectives are submitted in graph order (the
graph is the same on every rank); gradient buckets and their chunks in bucket index order
(see `GradientSync`). The dispatcher issues each priority class's collectives in
submission order on that class's own process groups; priority only delays a class, it
never reorders one (see `priority.py`).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import defaultdict
from datetime import timedelta
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..plan import DEFAULT_CLASS, PRIORITY_CLASSES, Topology
from .hierarchical_a2a import PHASES, NodeLayout, algorithm_for, hierarchical_all_to_all
from .priority import Dispatcher, Pending
from .stream_lanes import StreamLanes, lane_group_options
from .works import Running, reduce_scatter_by_all_to_all, work_in_thread

A2A_ALGORITHMS = ("flat", "hierarchical")


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
    priority: str = DEFAULT_CLASS
    peer: int = -1  # point-to-point: the peer's index in `group` (send_rows: a send, recv_rows: a receive)
    lane: str = ""


class CommScheduler:
    """Issues collectives on named groups, in priority lanes, and accounts for their bytes.

    Collectives go through a `Dispatcher` (see `priority.py`): `start_*` queues one and
    returns at once, `wait_tensor` / `wait` block until it is done (bounded by
    `timeout_s`); the blocking forms are start + wait. `a2a_algorithm` is "flat" (one
    all_to_all_single) or "hierarchical" (see `hierarchical_a2a.py`: each remote node gets
    a row once, forwarded inside the node; same result bit for bit) for groups that span nodes;
    `a2a_sites` overrides it per tag prefix (an MoE block's dispatch or combine, see
    `hierarchical_a2a.algorithm_for`), so one program runs some all-to-alls flat and others
    hierarchically. `local_only=True` replaces every
    collective by a local copy of the same size (the compute-only baseline of `commfx
    bench`); `records`, when a list, receives a CollectiveRecord per collective (to replay
    communication alone).
    """

    def __init__(self, topology: Topology, rank: int, groups: dict[str, "GroupHandle"], *, timeout_s: float = 300.0, device_type: str = "cpu"):
        self.topology = topology
        self.rank = rank
        self.groups = groups
        self.timeout_s = timeout_s
        self.stats = CommStats()
        self.local_only = False
        self.records: list[CollectiveRecord] | None = None
        self.dispatcher = StreamLanes() if device_type == "cuda" else Dispatcher()  # CUDA: NCCL streams, see stream_lanes.py
        self.a2a_algorithm = "flat"
        self.a2a_sites: dict[str, str] = {}  # tag prefix -> algorithm (hierarchical_a2a:enabled=auto)
        self._count_lock = threading.Lock()  # the dispatcher thread counts hierarchical phases
        self._started: dict[int, Pending] = {}  # id(output tensor) -> its collective
        self.op_state: dict = {}  # state an op reads when it runs, keyed by op id (e.g. resizable tp linears)
        self.blocked_s = 0.0  # seconds this rank has spent waiting on communication (compute = wall - blocked)
        self.slowdown = 1.0  # > 1: the executor stretches each compute node (a straggler, for `commfx bench --slow-rank`)
        self.slow_debt_s = 0.0  # delay the stretched nodes still owe (paid in slices, see executor.stretch)

    def group(self, name: str, priority: str = DEFAULT_CLASS) -> "GroupHandle":
        key = group_key(name, priority)
        try:
            return self.groups[key]
        except KeyError:
            if name not in self.groups:
                raise CommError(f"process group {name!r} is not in the plan (known: {', '.join(sorted(self.groups))})") from None
            raise CommError(
                f"priority class {priority!r} has no process groups of its own; register it "
                "(commfx.plan.register_priority_class) before the runtime builds its groups"
            ) from None

    # -- collectives -------------------------------------------------------------------

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_rows: list[int],
        recv_rows: list[int],
        group: str,
        priority: str = DEFAULT_CLASS,
        tag: str = "",
        kind: str = "all_to_all",
    ) -> torch.Tensor:
        """Queue an uneven all-to-all of rows; returns its output (valid after `wait_tensor`).
        `kind` is the name its bytes are counted under (e.g. "embedding_all_to_all")."""
        handle = self.group(group, priority)
        if len(send_rows) != handle.size or len(recv_rows) != handle.size:
            raise CommError(f"all_to_all on {group!r} needs {handle.size} splits, got {len(send_rows)}/{len(recv_rows)}")
        layout = NodeLayout(tuple(self.topology.node_of(r) for r in handle.ranks))
        algorithm = algorithm_for(tag, self.a2a_sites, self.a2a_algorithm) if self.a2a_sites else self.a2a_algorithm
        hierarchical = algorithm == "hierarchical" and layout.spans_nodes() and not self.local_only
        row_bytes = _row_bytes(x)
        if not hierarchical:  # the hierarchical phases count themselves when they run
            self._count(kind, handle, {handle.ranks[i]: n * row_bytes for i, n in enumerate(send_rows)})
        if self.records is not None:
            self.records.append(CollectiveRecord("all_to_all", group, tuple(send_rows), tuple(recv_rows), tuple(x.shape[1:]), x.dtype, priority))
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        if self.local_only:
            # Same bytes moved, no network: keep what fits, zeros for the rest.
            out.zero_()[: min(out.shape[0], x.shape[0])].copy_(x[: out.shape[0]])
            return out
        if handle.size == 1:
            out.copy_(x)
            return out
        x = x.contiguous()
        nbytes = sum(send_rows) * row_bytes
        if hierarchical:
            self._started[id(out)] = self.dispatcher.submit(
                Pending(kind, priority, group, tag, nbytes, lambda: self._hierarchical(out, x, send_rows, recv_rows, handle, layout, kind))
            )
            return out
        issue = lambda: dist.all_to_all_single(out, x, recv_rows, send_rows, group=handle.pg, async_op=True)  # noqa: E731
        self._started[id(out)] = self.dispatcher.submit(Pending(kind, priority, group, tag, nbytes, issue))
        return out

    def _hierarchical(self, out, x, send_rows, recv_rows, handle: "GroupHandle", layout: NodeLayout, kind: str) -> "Running":
        """Run a hierarchical all-to-all into `out` on a thread of its own (the dispatcher goes on
        to other lanes meanwhile): point-to-point messages on the group's own process group
        (this priority class's clone), only between ranks that exchange rows, each wait
        bounded by `timeout_s`. Its bytes are counted once it has run, as one call."""
        deadline = time.monotonic() + self.timeout_s
        short_receives = dist.get_backend(handle.pg) == "gloo"  # gloo takes a message shorter than the receive

        def exchange(phase, sends, receives):
            tag = _HIERARCHICAL_TAGS[PHASES.index(phase)]
            works = [dist.irecv(buf, src=handle.ranks[i], group=handle.pg, tag=tag) for i, buf in receives.items()]
            works += [dist.isend(buf, dst=handle.ranks[i], group=handle.pg, tag=tag) for i, buf in sends.items()]
            for work in works:
                left = deadline - time.monotonic()
                if left <= 0 or not work.wait(timedelta(seconds=left)):
                    raise CommError(f"hierarchical all_to_all ({phase}) on group {handle.name!r} did not finish within {self.timeout_s:.0f}s")

        sent: dict[int, int] = defaultdict(int)

        def count(phase, bytes_to_index):
            for i, n in bytes_to_index.items():
                sent[handle.ranks[i]] += n

        def run():
            hierarchical_all_to_all(x, send_rows, recv_rows, handle.rank, layout, exchange, count, short_receives=short_receives, out=out)
            self._count(kind, handle, dict(sent))

        return Running(run)

    def wait_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Block until the collective that produces `t` is done (no-op if none is pending)."""
        pending = self._started.pop(id(t), None)
        if pending is not None:
            self.wait(pending)
        return t

    def ready(self, t: torch.Tensor) -> bool:
        """Whether `wait_tensor(t)` would not block the host (its collective is done, or on a
        device-ordered lane issued; True if none is pending); never blocks, so a caller can
        use what has arrived and leave the rest on the wire."""
        pending = self._started.get(id(t))
        return pending is None or pending.done.is_set()

    def all_to_all(
        self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: str, priority: str = DEFAULT_CLASS, tag: str = "", kind: str = "all_to_all"
    ) -> torch.Tensor:
        return self.wait_tensor(self.start_all_to_all(x, send_rows, recv_rows, group, priority, tag, kind))

    def start_all_reduce(self, tensor: torch.Tensor, group: str, kind: str = "all_reduce", priority: str = DEFAULT_CLASS, tag: str = "") -> Pending | None:
        """Queue an in-place sum of `tensor` over `group`; None when there is nothing to wait for."""
        handle = self.group(group, priority)
        if handle.size == 1:
            return None
        # A ring all-reduce sends 2 (P-1)/P of the buffer to the next rank of the ring.
        payload = tensor.numel() * tensor.element_size()
        successor = handle.ranks[(handle.rank + 1) % handle.size]
        self._count(kind, handle, {successor: 2 * (handle.size - 1) * payload // handle.size})
        if self.records is not None:
            self.records.append(CollectiveRecord(kind, group, (tensor.numel(),), (tensor.numel(),), (), tensor.dtype, priority))
        if self.local_only:
            return None  # a local "reduction" over one replica leaves the tensor as it is
        issue = lambda: dist.all_reduce(tensor, group=handle.pg, async_op=True)  # noqa: E731
        return self.dispatcher.submit(Pending(kind, priority, group, tag, payload, issue))

    def start_sharded(self, op: str, out: torch.Tensor, x: torch.Tensor, group: str, kind: str, priority: str = DEFAULT_CLASS, tag: str = "") -> Pending | None:
        """Queue a `reduce_scatter` (out = this rank's shard of the sum of every rank's `x`)
        or an `all_gather` (out = every rank's `x`, in rank order) over `group`; `out` is
        valid after `wait`. A ring sends (P-1)/P of the full buffer to the next rank."""
        handle = self.group(group, priority)
        full = x if op == "reduce_scatter" else out
        if handle.size == 1 or self.local_only:  # no network: this rank's part of x, or x in every rank's slot
            out.view(-1, x.numel()).copy_(x) if op == "all_gather" else out.copy_(x[: out.numel()])
            return None
        payload = full.numel() * full.element_size()
        self._count(kind, handle, {handle.ranks[(handle.rank + 1) % handle.size]: (handle.size - 1) * payload // handle.size})
        if self.records is not None:
            self.records.append(CollectiveRecord(kind, group, (x.numel(),), (out.numel(),), (), x.dtype, priority))
        if op == "reduce_scatter" and dist.get_backend(handle.pg) == "gloo" and not self.dispatcher.device_ordered:  # gloo's sends as much as an all-reduce
            issue = lambda: reduce_scatter_by_all_to_all(out, x, handle.pg)  # noqa: E731
            return self.dispatcher.submit(Pending(kind, priority, group, tag, payload, issue))
        collective = dist.reduce_scatter_tensor if op == "reduce_scatter" else dist.all_gather_into_tensor
        issue = lambda: self._handle(collective(out, x, group=handle.pg, async_op=True))  # noqa: E731
        return self.dispatcher.submit(Pending(kind, priority, group, tag, payload, issue))

    def all_reduce(self, tensor: torch.Tensor, group: str, kind: str = "all_reduce", priority: str = DEFAULT_CLASS) -> torch.Tensor:
        """Sum `tensor` in place over `group`."""
        self.wait(self.start_all_reduce(tensor, group, kind, priority))
        return tensor

    def start_send(self, tensor: torch.Tensor, group: str, peer: int, *, kind: str, priority: str, lane: str, tag: str = "") -> Pending | None:
        """Queue a point-to-point send of `tensor` to index `peer` of `group`, in its own
        lane: sends in one lane go in submission order, and never wait behind a receive."""
        handle = self.group(group, priority)
        payload = tensor.numel() * tensor.element_size()
        self._count(kind, handle, {handle.ranks[peer]: payload})
        if self.records is not None:
            self.records.append(CollectiveRecord(kind, group, (tensor.numel(),), (), (), tensor.dtype, priority, peer, lane))
        if self.local_only:
            return None
        tensor = tensor.contiguous()
        issue = lambda: self._handle(dist.isend(tensor, dst=handle.ranks[peer], group=handle.pg))  # noqa: E731
        return self.dispatcher.submit(Pending(kind, priority, group, tag, payload, issue, lane=lane))

    def start_recv(self, out: torch.Tensor, group: str, peer: int, *, kind: str, priority: str, lane: str, tag: str = "") -> Pending | None:
        """Queue a receive into `out` from index `peer` of `group` (valid after `wait`)."""
        handle = self.group(group, priority)
        if self.records is not None:
            self.records.append(CollectiveRecord(kind, group, (), (out.numel(),), (), out.dtype, priority, peer, lane))
        if self.local_only:
            out.zero_()
            return None
        issue = lambda: self._handle(dist.irecv(out, src=handle.ranks[peer], group=handle.pg))  # noqa: E731
        return self.dispatcher.submit(Pending(kind, priority, group, tag, out.numel() * out.element_size(), issue, lane=lane))

    def all_gather_object(self, obj, group: str = "world") -> list:
        handle = self.group(group)
        out = [None] * handle.size
        self._blocking("all_gather_object", group, lambda: dist.all_gather_object(out, obj, group=handle.pg))
        return out

    def broadcast(self, tensor: torch.Tensor, group: str = "world", src_index: int = 0) -> torch.Tensor:
        """Overwrite `tensor` in place with index `src_index`'s copy in `group` (bounded wait)."""
        handle = self.group(group)
        if handle.size > 1:
            self._blocking("broadcast", group, lambda: dist.broadcast(tensor, src=handle.ranks[src_index], group=handle.pg))
        return tensor

    def barrier(self, group: str = "world") -> None:
        handle = self.group(group)
        self._blocking("barrier", group, lambda: dist.barrier(group=handle.pg))

    def wait(self, pending: Pending | None) -> None:
        """Block until `pending` is done; a failure or a timeout raises CommError."""
        if pending is None:
            return
        start = time.perf_counter()
        finished = self.dispatcher.wait(pending, self.timeout_s)
        self.blocked_s += time.perf_counter() - start
        if not finished:
            raise CommError(
                f"{pending.kind} on group {pending.group!r} ({pending.priority}) did not finish within "
                f"{self.timeout_s:.0f}s on rank {self.rank}. Another rank probably died or is stuck; check its log."
            )
        if pending.error is not None:
            raise CommError(
                f"{pending.kind} on group {pending.group!r} failed on rank {self.rank}: {pending.error}. "
                "Another rank probably died or timed out; check its log."
            ) from pending.error

    # -- bookkeeping -------------------------------------------------------------------

    def _handle(self, work):
        """What the dispatcher waits on: the work itself where its wait orders the device
        (NCCL), else a thread waiting on it (gloo's point-to-point works have no future)."""
        return work if self.dispatcher.device_ordered else work_in_thread(work, self.timeout_s)

    def _count(self, kind: str, handle: "GroupHandle", bytes_to_rank: dict[int, int]) -> None:
        my_node = self.topology.node_of(self.rank)
        with self._count_lock:
            self.stats.calls[kind] += 1
            for peer, nbytes in bytes_to_rank.items():
                if peer == self.rank:
                    continue
                same_node = self.topology.node_of(peer) == my_node
                (self.stats.intra_node_bytes if same_node else self.stats.inter_node_bytes)[kind] += nbytes

    def _blocking(self, kind: str, group: str, fn) -> None:
        """Run a synchronous collective in the default lane (it shares that lane's groups)."""

        def issue():
            fn()
            return None

        self.wait(self.dispatcher.submit(Pending(kind, DEFAULT_CLASS, group, "", 0, issue)))


# point-to-point tags of the hierarchical all-to-all's three exchanges (apart from other p2p on the group)
_HIERARCHICAL_TAGS = (0x2A2A01, 0x2A2A02, 0x2A2A03)


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


def group_key(name: str, priority: str = DEFAULT_CLASS) -> str:
    """The default class uses the plan's groups; every other class its own clones ("grad/world")."""
    return name if priority == DEFAULT_CLASS else f"{priority}/{name}"


def build_groups(topology: Topology, rank: int, timeout_s: float | None = None, device_type: str = "cpu") -> dict[str, GroupHandle]:
    """Create every process group of the plan, once per priority class (collectively: all
    ranks call this, and create every group in the same order).

    With `timeout_s`, every rank first meets the others at a monitored barrier: a rank that
    never arrives (hung or slow in user code before `distribute`) is named in the error
    within that time, and group creation is bounded by it too."""
    if timeout_s is not None and topology.world_size > 1 and dist.is_initialized():
        _rendezvous(timeout_s)
    bound = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    handles: dict[str, GroupHandle] = {}
    world = list(range(topology.world_size))
    for priority in sorted(PRIORITY_CLASSES, key=lambda n: PRIORITY_CLASSES[n].level):
        wanted = PRIORITY_CLASSES[priority].groups
        options = lane_group_options(device_type, priority)  # CUDA: classes that block compute get high-priority streams
        made: dict[tuple[int, ...], object] = {}  # one c10d group per rank list and class (dp is the world when pp = 1)
        for name, rank_lists in topology.process_groups().items():
            if wanted and name not in wanted:
                continue
            for ranks in rank_lists:
                if ranks == world and len(ranks) > 1 and priority == DEFAULT_CLASS and options is None:
                    pg = dist.group.WORLD
                elif tuple(ranks) in made:
                    pg = made[tuple(ranks)]
                elif len(ranks) > 1:
                    pg = dist.new_group(ranks, pg_options=options, **bound)  # collective over the world: every rank creates every group
                else:
                    pg = None
                made[tuple(ranks)] = pg
                if rank in ranks:
                    key = group_key(name, priority)
                    handles[key] = GroupHandle(key, pg, ranks, ranks.index(rank))
    return handles


def _rendezvous(timeout_s: float) -> None:
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as error:
        missing = re.findall(r"\d+", str(error).split("failed to pass", 1)[0].rsplit("Ranks", 1)[-1]) if "failed to pass" in str(error) else []
        who = f"rank(s) {', '.join(missing)}" if missing else "some rank"
        raise CommError(
            f"{who} did not reach commfx's rendezvous (building process groups in distribute or the backend) "
            f"within {timeout_s:g}s: they are hung or slow in the code before it, or died. Plan.collective_timeout_s "
            f"sets this bound. ({str(error).strip().splitlines()[0]})"
        ) from None


def local_scheduler(topology: Topology | None = None) -> CommScheduler:
    """A scheduler for a world of one (the single-process reference and dumps)."""
    topology = topology or Topology(world_size=1)
    groups = {
        group_key(name, priority): GroupHandle(group_key(name, priority), None, [0], 0)
        for priority in PRIORITY_CLASSES
        for name in topology.process_groups()
        if not PRIORITY_CLASSES[priority].groups or name in PRIORITY_CLASSES[priority].groups
    }
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
