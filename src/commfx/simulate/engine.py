"""The event simulation of one rank's step: one compute stream and the comm scheduler's lanes.

Compute runs the workload's items in order, each for its roofline time. A collective is
submitted to its priority class's lane and issued by the runtime's own rule
(`runtime.priority.next_lane`: one in flight per lane, lower classes held back while a
higher one is busy when priority is on). An issued collective pays its latency (per-call
overhead plus link latency per step), then shares the links with the others in flight
(processor sharing: n on the wire each progress at 1/n). A wait blocks compute until its
collective is done; gradients go out bucket by bucket (`buckets.make_buckets`, the
runtime's rule) in chunks of the plan's gradient chunk, in the `grad` class. The step
ends when the optimizer has stepped, after every collective finished, but for the row
exchanges `split_embedding_comm:schedule=2d` posts into the next step (`rows`): such a
workload runs two steps, the second's lookups waiting for the first's rows the next batch
reads (`rows_next`) and stepping those, its optimizer step waiting for the others
(`rows_later`) and stepping the rest of each table first; the second is the step reported.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from ..buckets import Entry, make_buckets
from ..compiler.program import Program
from ..plan import Plan
from ..runtime.hierarchical_a2a import algorithm_for
from ..runtime.priority import Pending, next_lane
from ..runtime.row_schedule import LATER_CLASS, NEXT_CLASS
from ..runtime.trace import ComputeSpan, Timeline
from .cluster import Cluster
from .collectives import LinkLoad, group_of_rank0, link_load
from .workload import Comm, Item, Workload

GRAD_CLASS = "grad"
STEP_IDS = 1 << 40  # the second simulated step's collective ids start here


@dataclass
class Flight:
    comm: Comm
    load: LinkLoad
    pending: Pending
    wire_start: float = 0.0
    remaining: float = 0.0  # seconds of wire time at a full share


@dataclass
class Result:
    step_s: float
    compute_s: float
    comm_s: float  # time at least one collective was in flight
    exposed_comm_s: float  # time compute waited on communication
    inter_node_bytes: float  # this node's link, per direction
    intra_node_bytes: float  # one rank's
    collectives: int
    memory: dict[str, float]
    timeline: Timeline
    history: list[Pending] = field(default_factory=list)
    boundary_bytes: float = 0.0  # a pipeline's: every boundary's sends per step, both ways

    def link_utilisation(self, cluster: Cluster) -> dict[str, float]:
        return {
            "inter_node": self.inter_node_bytes / (self.step_s * cluster.inter_node.bandwidth) if self.step_s else 0.0,
            "intra_node": self.intra_node_bytes / (self.step_s * cluster.intra_node.bandwidth) if self.step_s else 0.0,
        }


def locality_remote_share(plan: Plan, program: Program) -> float | None:
    """The off-node share of the expert all-to-alls under locality_gate (its cap on tokens
    leaving their node), or None: uniform routing (no gate, or a baseline gate)."""
    from ..passes.locality_gate import BASELINES, default_remote_fraction

    for spec in plan.passes:
        if spec.name == "locality_gate" and str(spec.options.get("gate", "model")) not in BASELINES:
            fraction = spec.options.get("max_remote_fraction")
            blocks = program.regions.moe_blocks
            return float(fraction) if fraction is not None else default_remote_fraction(blocks[0].top_k if blocks else 1)
    return None


class Simulation:
    def __init__(self, workload: Workload, program: Program, plan: Plan, cluster: Cluster):
        self.workload, self.plan, self.cluster = workload, plan, cluster
        self.priority = program.runtime.comm_schedule.priority
        self.chunk_bytes = program.runtime.comm_schedule.grad_chunk_bytes
        sharded = getattr(program.runtime, "shard_states", None) or {}
        self.zero = int(sharded.get("stage", 0))
        self.bucket_bytes = int(sharded.get("bucket_bytes") or 0) or plan.grad_bucket_bytes
        self.remote_share = locality_remote_share(plan, program)
        # the all-to-all algorithm of each tag, as the runtime's scheduler picks it (hierarchical_a2a)
        self.a2a_algorithm = getattr(program.runtime, "a2a_algorithm", "flat")
        self.a2a_sites = dict(getattr(program.runtime, "a2a_sites", None) or {})
        self.lanes: dict[str, deque] = {}
        self.in_flight: dict[str, Flight | None] = {}
        self.class_of: dict[str, str] = {}
        self.wire: list[Flight] = []  # issued, latency or bytes still to go
        self.done: dict[int, float] = {}
        self.now = 0.0
        self.comm_busy = 0.0
        self.inter = self.intra = 0.0
        self.timeline = Timeline(0)
        self.history: list[Pending] = []
        self.groups: dict[str, list[int]] = {}
        self.offset = 0  # added to this step's collective ids (`run`)
        self.posted: dict[str, list[tuple[int, str]]] = {}  # table -> (id, class) of row exchanges posted this step (schedule=2d)
        self.carried: dict[str, list[tuple[int, str]]] = {}  # table -> those the step before posted
        self.owed: list[Item] = []  # this step's "later" items: the tables' other rows, stepped before the optimizer step
        self.deferred: set[int] = set()  # every posted exchange: the optimizer step does not wait for them

    # ------------------------------------------------------------------ the comm side

    def submit(self, comm: Comm, at: float) -> None:
        group = self.groups.get(comm.group) or self.groups.setdefault(comm.group, self._group(comm.group))
        share = self.remote_share if comm.kind == "all_to_all" and comm.group == "ep" else None
        algorithm = self.algorithm_of(comm)
        load = link_load(comm.kind, comm.payload, group, self.plan.topology, self.cluster, share,
                         algorithm=algorithm, row_bytes=comm.row_bytes, duplicate_share=comm.duplicate_share)
        pending = Pending(comm.label, comm.priority, comm.group, comm.tag, int(comm.payload), None, t_submit=at)
        self.lanes.setdefault(comm.priority, deque()).append(Flight(comm, load, pending))
        self.in_flight.setdefault(comm.priority, None)
        self.class_of[comm.priority] = comm.priority
        self.inter += load.inter_bytes
        self.intra += load.intra_bytes
        self._issue(at)

    def algorithm_of(self, comm: Comm) -> str:
        """flat | hierarchical: what the runtime runs this collective with (all-to-alls only)."""
        if comm.kind != "all_to_all":
            return "flat"
        return algorithm_for(comm.tag, self.a2a_sites, self.a2a_algorithm)

    def _group(self, name: str) -> list[int]:
        return list(range(self.plan.topology.world_size)) if name == "world" else group_of_rank0(self.plan.topology, name)

    def _issue(self, at: float) -> None:
        while (lane := next_lane(self.lanes, self.in_flight, self.class_of, self.priority)) is not None:
            flight = self.in_flight[lane] = self.lanes[lane].popleft()
            flight.pending.t_issue = at
            flight.wire_start = at + flight.load.latency(self.cluster)
            flight.remaining = flight.load.seconds(self.cluster)
            self.wire.append(flight)

    def advance(self, until: float, stop_at: int | None = None) -> None:
        """Run the links from `now` to `until` (or until collective `stop_at` is done)."""
        while self.now < until and not (stop_at is not None and stop_at in self.done):
            if not self.wire:
                self.now = until
                return
            sending = [f for f in self.wire if f.wire_start <= self.now]
            share = len(sending)
            candidates = [until] + [f.wire_start for f in self.wire if f.wire_start > self.now]
            candidates += [self.now + f.remaining * share for f in sending]
            step_to = min(candidates)
            elapsed = step_to - self.now
            for f in sending:
                f.remaining -= elapsed / share
            self.comm_busy += elapsed
            self.now = step_to
            finished = [f for f in self.wire if f.wire_start <= self.now and f.remaining <= 1e-12]
            for f in finished:
                self.wire.remove(f)
                self.in_flight[f.comm.priority] = None
                f.pending.t_done = self.now
                self.done[f.comm.id] = self.now
                self.history.append(f.pending)
            if finished:
                self._issue(self.now)

    def wait(self, comm_id: int) -> None:
        while comm_id not in self.done:
            if not self.wire and not any(self.lanes.values()):
                raise RuntimeError(f"collective {comm_id} was waited for but never submitted")
            self.advance(float("inf"), stop_at=comm_id)

    # ------------------------------------------------------------------ the compute side

    def run(self) -> Result:
        """One training step; two where row exchanges run into the next step
        (split_embedding_comm:schedule=2d posts them in the backward and the next forward
        waits for them), of which the second, the steady state, is reported."""
        steps = 2 if any(item.what == "post" for item in self.workload.items) else 1
        if steps == 2:
            self.priority = True  # the row schedule turns priority on (RowSchedule.attach)
        t = start = 0.0
        for index in range(steps):
            start, self.offset = t, index * STEP_IDS
            self.carried, self.posted, self.owed = self.posted, {}, []
            self.comm_busy = self.inter = self.intra = 0.0
            t, compute, blocked, collectives = self._step(t)
            self.timeline.step(index, start, t)
        return Result(t - start, compute, self.comm_busy, blocked, self.inter, self.intra, collectives, self._memory(), self.timeline, self.history)

    def _step(self, t: float) -> tuple[float, float, float, int]:
        """The workload's items once, from `t`: (end, compute, blocked on communication, collectives)."""
        compute, blocked, collectives = 0.0, 0.0, 0
        buckets = self._buckets()
        ready: set[str] = set()
        next_bucket = 0
        bucket_of = {name: index for index, (_, members, _) in enumerate(buckets) for name in members}
        gathers = self._gather(buckets, 1, t) if self.zero == 3 else []
        collectives += len(gathers)
        phase = "forward"
        for item in self.workload.items:
            if item.phase != phase and phase == "forward" and self.zero == 3:
                end = self._wait_all(gathers, t)
                blocked += end - t
                t = end
                gathers = self._gather(buckets, 2, t)
                collectives += len(gathers)
            phase = item.phase
            if gathers and item.params and item.what in ("compute", "grads"):  # stage 3: a bucket is whole before its use
                end = self._wait_all([gathers[bucket_of[p]] for p in item.params if p in bucket_of], t)
                blocked += end - t
                t = end
            if item.what == "compute":
                if item.phase == "optimizer":
                    start = t
                    pending = [f.comm.id for f in self.wire] + [f.comm.id for q in self.lanes.values() for f in q]
                    for comm_id in (c for c in pending if c not in self.deferred):
                        self.advance(float("inf"), stop_at=comm_id)
                        t = max(t, self.done[comm_id])
                    if t > start:
                        self.timeline.spans.append(ComputeSpan("grads", "wait for gradients", "optimizer", start, t, True))
                        blocked += t - start
                    t, owed_compute, owed_blocked = self._step_owed(t)
                    compute += owed_compute
                    blocked += owed_blocked
                seconds = self._compute(item, item.label, t)
                t += seconds
                compute += seconds
            elif item.what in ("start", "post"):
                comm = self._own(item.comm)
                self.advance(t)
                self.submit(comm, t)
                collectives += 1
                if item.what == "post":  # schedule=2d: waited by the next step's lookup, not by the optimizer
                    self.posted.setdefault(item.label, []).append((comm.id, comm.priority))
                    self.deferred.add(comm.id)
            elif item.what in ("wait", "settle"):
                ids = [item.comm_id + self.offset] if item.what == "wait" else [c for c, p in self.carried.get(item.label, []) if p == NEXT_CLASS]
                end = self._wait_for(ids, t)
                if end > t:
                    self.timeline.spans.append(ComputeSpan(item.name, "wait" if item.what == "wait" else "wait for rows", item.phase, t, end, True))
                blocked += end - t
                t = end
                if item.what == "settle":  # the next batch's rows are in: add them up and step those
                    seconds = self._compute(item, f"step {item.label}", t)
                    t += seconds
                    compute += seconds
            elif item.what == "later":  # the table's other rows: stepped before the optimizer step
                self.owed.append(item)
            elif item.what == "grads":
                ready.update(item.params)
                self.advance(t)
                while next_bucket < len(buckets) and all(p in ready for p in buckets[next_bucket][1]):
                    collectives += self._submit_bucket(next_bucket, *buckets[next_bucket], t)
                    next_bucket += 1
        if self.zero in (1, 2):  # the updated shards all-gathered after the step
            gathers = self._gather(buckets, 3, t)
            collectives += len(gathers)
            end = self._wait_all(gathers, t)
            blocked += end - t
            t = end
        return t, compute, blocked, collectives

    def _wait_for(self, ids: list[int], t: float) -> float:
        """When the collectives `ids` are all done, waited for from time t."""
        self.advance(t)
        end = t
        for ident in ids:
            self.wait(ident)
            end = max(end, self.done[ident])
        return end

    def _step_owed(self, t: float) -> tuple[float, float, float]:
        """Before the optimizer step: wait for the step before's other rows of each table
        (`rows_later`) and step them. Returns (end, compute, blocked)."""
        compute = blocked = 0.0
        for item in self.owed:
            ids = [c for c, p in self.carried.get(item.label, []) if p == LATER_CLASS]
            if not ids:
                continue  # the first simulated step: nothing was posted before it
            end = self._wait_for(ids, t)
            if end > t:
                self.timeline.spans.append(ComputeSpan(item.name, "wait for other rows", "optimizer", t, end, True))
                blocked += end - t
            seconds = self._compute(dataclasses.replace(item, phase="optimizer"), f"step {item.label} (other rows)", end)
            t = end + seconds
            compute += seconds
        return t, compute, blocked

    def _compute(self, item: Item, label: str, at: float) -> float:
        """Run `item`'s compute from `at` (the links go on meanwhile); its seconds."""
        dtype = "bf16" if self.plan.precision == "bf16" else "fp32"
        seconds = self.cluster.device.op_seconds(item.flops, item.nbytes, dtype)
        self.advance(at + seconds)
        self.timeline.spans.append(ComputeSpan(item.name, label, item.phase, at, at + seconds, False))
        return seconds

    def _own(self, comm: Comm) -> Comm:
        """`comm` as this step's (its id apart from the same collective's in the step before)."""
        return dataclasses.replace(comm, id=comm.id + self.offset) if self.offset else comm

    def _buckets(self) -> list[tuple[str, list[str], float]]:
        names = list(self.workload.params)
        entries = [Entry(g, "float", n, size) for n, size, g in self.workload.params.values()]
        out = []
        for group, indices in make_buckets(entries, self.bucket_bytes):
            members = [names[i] for i in indices]
            out.append((group, members, float(sum(entries[i].numel * entries[i].element_size for i in indices))))
        return out

    def _submit_bucket(self, index: int, group: str, members: list[str], nbytes: float, at: float) -> int:
        chunk = self.chunk_bytes if self.chunk_bytes else nbytes
        count = max(1, -(-int(nbytes) // int(chunk)))
        for i in range(count):
            size = min(chunk, nbytes - i * chunk)
            kind = "reduce_scatter" if self.zero >= 2 else "all_reduce"
            comm = Comm(-(index * 10_000 + i + 1) + self.offset, kind, f"grad_{kind}", group, GRAD_CLASS, f"bucket {index} chunk {i + 1}/{count}", size)
            self.submit(comm, at)
        return count

    def _gather(self, buckets, phase: int, at: float) -> list[int]:
        """All-gather every bucket's parameters (shard_states), in bucket order; their ids."""
        ids = []
        for index, (group, _, nbytes) in enumerate(buckets):
            ident = -(10_000_000 * phase + index + 1) + self.offset
            self.submit(Comm(ident, "all_gather", "param_all_gather", group, GRAD_CLASS, f"bucket {index} gather", nbytes), at)
            ids.append(ident)
        return ids

    def _wait_all(self, ids: list[int], at: float) -> float:
        self.advance(at)
        for ident in ids:
            self.wait(ident)
        return max([at] + [self.done[i] for i in ids])

    def _memory(self) -> dict[str, float]:
        """Held bytes per rank: parameters, gradients, AdamW's two moments (cut over each
        bucket's group as far as the shard_states stage goes; stage 3 holds its two largest
        buckets whole while they are gathered), and the activations kept for backward."""
        sizes = {name: len(ranks[0]) for name, ranks in self.plan.topology.process_groups().items()}
        whole = sum(n * s for n, s, _ in self.workload.params.values())
        cut = sum(n * s / (sizes.get(g, 1) if g else 1) for n, s, g in self.workload.params.values())
        gathered = sum(sorted((b for _, _, b in self._buckets()), reverse=True)[:2])
        memory = {
            "parameters": min(whole, cut + gathered) if self.zero >= 3 else whole,
            "gradients": cut if self.zero >= 2 else whole,
            "optimizer_state": 2 * (cut if self.zero >= 1 else whole),
            "activations": self.workload.activation_bytes,
        }
        memory["total"] = sum(memory.values())
        return memory
