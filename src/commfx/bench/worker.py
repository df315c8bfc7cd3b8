"""What each rank of `commfx bench` runs (:func:`bench_worker`, started by the launcher):
every plan's distributed module, then interleaved rounds of the three timed phases (see
:mod:`commfx.bench.harness`), and the samples sent back to the parent."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..runtime.machine_probe import NOTE as MACHINE_NOTE
from .config import BenchConfig, PlanSpec
from .results import TIMING_KINDS
from .straggler import RankSlowdown
from .stream import digest
from .wire import read_counters


class _Runner:
    """One plan's (or peer's) model on this rank: the timed rounds and their samples, with the
    link counters read around each real step. Subclasses say how to train, replay and count."""

    def __init__(self, spec: PlanSpec, config: BenchConfig, rank: int):
        self.spec = spec
        self.samples: dict[str, list] = {kind: [] for kind in TIMING_KINDS} | {"bytes": [], "own_compute": [], "wire": [], "messages": []}
        # Bytes on the wire: every rank takes part in the barriers that close the counted span;
        # one rank per node (its first) reads the node's link counters.
        self.count_wire = bool(config.link_devices)
        node, local_rank = divmod(rank, config.ranks_per_node)
        self.link_device = config.link_devices[node] if self.count_wire and local_rank == 0 else None
        self.samples["wire_device"] = self.link_device
        self.steps_per_round = config.steps_per_round
        self.messages = 0.0
        self.stream = config.stream
        self.rounds = 0  # rounds loaded so far: round r trains on the stream's steps r * steps_per_round, ...
        self.batches: list = []  # this round's batches (this rank's shares), and the next step's after them
        self.samples["batches"] = []  # per measured round: the digest of each step's global batch

    def _share(self, batch):
        """This rank's share of a global batch (`shares`: the (parts, index) the subclass set)."""
        from ..verify import local_batch

        return local_batch(batch, *self.shares)

    def _load_round(self) -> list[int]:
        """This round's batches and the one after them, made before any clock starts (a data
        loader has the next batch ready); the digests of the round's global batches."""
        if self.stream is None:
            self.batches = [self.inputs] * (self.steps_per_round + 1)
            return [self.example_digest] * self.steps_per_round
        first = self.rounds * self.steps_per_round
        batches = [self.stream.batch(self.example, first + i) for i in range(self.steps_per_round + 1)]
        self.batches = [self._share(b) for b in batches]
        return [digest(b) for b in batches[:-1]]

    def step(self) -> tuple[tuple[float, float], dict]:
        """A real training step; records its collectives, exact bytes and wire bytes for this round.

        The link counters are read before the barrier that starts the timed span (so no
        rank of any node sends a byte of the step before every node has read them) and
        again after a barrier that follows the span: once every rank is past the step,
        everything the step sent has arrived. The difference holds all of the step's
        traffic plus the two barriers' few hundred bytes, and nothing of the next phase."""
        self._start_counting()
        if self.count_wire:
            self.barrier()  # every rank is done with the previous phase's traffic
        before = self._link_counters()
        self.barrier()
        blocked = self._blocked_s()
        start = time.monotonic()
        self._train_steps()
        span = _per_step(start, time.monotonic(), self.steps_per_round)
        self.own_compute = span[1] - span[0] - (self._blocked_s() - blocked) / self.steps_per_round  # wall less comm waits
        if self.count_wire:
            self.barrier()
        after = self._link_counters()
        self.wire = None if before is None else ((after.tx_bytes - before.tx_bytes) / self.steps_per_round,
                                                 (after.rx_bytes - before.rx_bytes) / self.steps_per_round)
        return span, self._stop_counting()

    def _link_counters(self):
        return read_counters(self.link_device) if self.link_device is not None else None

    def round(self, keep: bool, slowdown: RankSlowdown, slowed: bool) -> None:
        """Run the three phases once (this rank slowed if it is the straggler and the plan is
        not a healthy reference); keep the samples unless this is warm-up."""
        digests = self._load_round()
        self.rounds += 1
        with slowdown.applied(self.scheduler, active=slowed):
            wall, nbytes = self.step()
            compute = self.compute_only()
        comm = self.comm_only()
        if keep:
            for kind, value in zip(TIMING_KINDS, (wall, compute, comm)):
                self.samples[kind].append(value)
            self.samples["bytes"].append(nbytes)
            self.samples["wire"].append(self.wire)
            self.samples["messages"].append(self.messages)
            self.samples["own_compute"].append(self.own_compute)
            self.samples["batches"].append(digests)

    def decisions(self) -> list[str]:
        return []

    def choices(self) -> list[str]:
        return []

    def compiled_with(self) -> dict | None:
        return None

    @property
    def placement_lines(self) -> list[str]:
        return []


class _PlanRunner(_Runner):
    """One plan's distributed module on this rank, able to run the three timed phases."""

    def __init__(self, spec: PlanSpec, config: BenchConfig, rank: int, world_size: int):
        super().__init__(spec, config, rank)
        from ..api import distribute
        from ..models import load_model
        from ..runtime.pipeline.module import PipelineModule
        from ..runtime.sharded_optimizer import shard_optimizer
        from ..verify import data_share, local_batch

        model, inputs = load_model(config.model, seed=config.seed, **config.model_kwargs)
        self.example, self.example_digest, self.shares = inputs, digest(inputs), data_share(spec.plan, rank)
        self.inputs = local_batch(inputs, *self.shares)  # a tuple, or a dict of keyword tensors
        self.dm = distribute(model, spec.plan, self.inputs)
        self.pipelined = isinstance(self.dm, PipelineModule)
        self.scheduler = self.dm.scheduler
        self.optimizer = shard_optimizer(self.dm, torch.optim.AdamW, lr=config.lr)  # sharded under shard_states, else plain AdamW
        self.records: list = []
        self.controller = getattr(self.dm, "straggler", None)  # resize_tp's SEMI controller, if the plan has one
        if hasattr(self.dm, "attach_optimizer"):
            # As a training run does: SEMI's migrated units move their AdamW state with them,
            # defer_grad_sync's optimizer catches deferred parameters up, and pack_experts
            # re-places experts after every replace_every-th optimizer step, inside the step
            # (so inside the timed span and its byte count; never in the compute-only replay).
            self.dm.attach_optimizer(self.optimizer)
        else:  # a pipeline module: no packing
            if self.controller is not None:
                self.controller.attach_optimizer(self.optimizer)
            if getattr(self.dm, "deferred", None) is not None:
                self.dm.deferred.attach(self.optimizer)

    def barrier(self) -> None:
        self.scheduler.barrier()

    def _blocked_s(self) -> float:
        return self.scheduler.blocked_s

    def _start_counting(self) -> None:
        self.scheduler.stats.reset()
        self.scheduler.records = []

    def _stop_counting(self) -> dict:
        self.records, self.scheduler.records = self.scheduler.records, None
        self.messages = self._crossing_messages() / self.steps_per_round
        return {kind: {k: v / self.steps_per_round for k, v in entry.items()} for kind, entry in self.scheduler.stats.as_dict().items()}

    def _train_step(self, inputs, next_inputs) -> None:
        """One training step on `inputs`; before its backward the module is told the next
        step's batch (`dm.next_batch`, as `commfx run` does: schedule=2d sends those rows first)."""
        from ..runtime.comm import install_default
        from ..train import loss_fn
        from ..verify import batch_tensors, call, pipeline_step

        # Backward comm ops find the process-default scheduler: make it this plan's.
        install_default(self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipelined:
            pipeline_step(self.dm, inputs, loss_fn=lambda outputs, mb: loss_fn(outputs, mb.inputs))
        else:
            loss = loss_fn(call(self.dm, inputs), batch_tensors(inputs))
            call(self.dm.next_batch, next_inputs)
            loss.backward()
        self.optimizer.step()

    def _crossing_messages(self) -> int:
        """Collectives of this round that cross nodes, in this rank's longest lane (a lane
        issues one at a time, each waiting for the one before: the latency term of the wire
        bound)."""
        topology, lanes = self.scheduler.topology, {}
        my_node = topology.node_of(self.scheduler.rank)
        for record in self.records:
            ranks = self.scheduler.group(record.group).ranks
            peers = [ranks[record.peer]] if record.peer >= 0 else ranks
            if any(topology.node_of(peer) != my_node for peer in peers):
                key = (record.priority, record.lane)
                lanes[key] = lanes.get(key, 0) + 1
        return max(lanes.values(), default=0)

    def _train_steps(self) -> None:
        """`steps_per_round` training steps back to back, then every deferred gradient settled
        (stage 3's parameters stay sharded: the next step's forward gathers them, as in training)."""
        for index in range(self.steps_per_round):
            self._train_step(self.batches[index], self.batches[index + 1])
        if not self.pipelined:
            self.dm.settle()

    @property
    def placement_lines(self) -> list[str]:
        """What each pack_experts re-placement did (the same on every rank but the bytes,
        which are this rank's), from the module's log."""
        return [f"after step {d.step}: {d.op_id} moved {d.moved} experts ({d.sent_bytes} B sent by this rank), co-located "
                f"selections {d.colocated_before:.0f} -> {d.colocated_after:.0f}, max load {d.max_load:.0f} (bound {d.bound:.0f})"
                + (f"; a better placement declined: it would repay its move in {d.payback_steps:.0f} steps" if d.declined else "")
                for decisions in getattr(self.dm, "placement_log", []) for d in decisions]

    def compute_only(self) -> tuple[float, float]:
        """The same step with every collective replaced by a same-size local copy."""
        self.scheduler.barrier()  # a real barrier, before the collectives turn local
        self.scheduler.local_only = True
        if self.controller is not None:
            self.controller.enabled = False  # local timings only: nothing to decide on
        try:
            start = time.monotonic()
            self._train_steps()
            return _per_step(start, time.monotonic(), self.steps_per_round)
        finally:
            self.scheduler.local_only = False
            if self.controller is not None:
                self.controller.enabled = True

    def comm_only(self) -> tuple[float, float]:
        """The collectives of this round's training step, alone, back to back."""
        buffers = [_dummy_buffer(r) for r in self.records]  # allocated outside the timing
        self.scheduler.barrier()
        start = time.monotonic()
        transfers = []  # point-to-point: queued in record order (a lane per direction), waited at the end
        for record, buffer in zip(self.records, buffers):
            if record.peer >= 0:
                start_p2p = self.scheduler.start_send if record.send_rows else self.scheduler.start_recv
                transfers.append(start_p2p(buffer, record.group, record.peer, kind=record.kind, priority=record.priority, lane=record.lane))
            elif record.kind == "all_to_all":
                self.scheduler.all_to_all(buffer, list(record.send_rows), list(record.recv_rows), record.group)
            else:
                self.scheduler.all_reduce(buffer, record.group, kind=record.kind)
        for pending in transfers:
            self.scheduler.wait(pending)
        return _per_step(start, time.monotonic(), self.steps_per_round)

    def traced_round(self, rank: int, trace_dir: str) -> str:
        """One more round with the timeline on (its `steps_per_round` steps, each a slice on
        the steps track, and the final settling of deferred traffic): later steps show the
        steady state, where the previous step's deferred work runs in this one's forward.
        Writes this rank's trace file."""
        from ..runtime.trace import Timeline, rank_trace_path

        self._load_round()
        self.rounds += 1
        self.dm.timeline, self.scheduler.dispatcher.history = Timeline(rank), []
        try:
            self.scheduler.barrier()
            for index in range(self.steps_per_round):
                start = time.perf_counter()
                self._train_step(self.batches[index], self.batches[index + 1])
                self.dm.timeline.step(index, start, time.perf_counter())
            if not self.pipelined:
                self.dm.settle()
            path = rank_trace_path(Path(trace_dir) / f"{self.spec.label}.json", rank)
            return str(self.dm.timeline.write(path, self.scheduler.dispatcher.history))
        finally:
            self.dm.timeline, self.scheduler.dispatcher.history = None, None

    def choices(self) -> list[str]:
        """The measured machine and the cost models' choices made from it (the same on every rank)."""
        return [n for n in self.dm.program.notes if n.startswith((MACHINE_NOTE, "partition_a2a:"))]

    def compiled_with(self) -> dict:
        """The cost models' figures the plan compiled with (measured on the ranks or given) and
        the automatic choices they made: what `commfx simulate --validate` compiles with and checks."""
        from ..cost.figures import figures_of
        from ..passes.choices import automatic_choices

        plan = self.dm.plan
        return {"machine": plan.machine, "figures": figures_of(plan.topology), "choices": automatic_choices(self.dm.program, plan)}

    def decisions(self) -> list[str]:
        """What resize_tp's controller did (the same on every rank)."""
        if self.controller is None:
            return []
        return [d.line() for d in self.controller.decisions if d.action != "keep"]


class _PeerRunner(_Runner):
    """A peer (`peer:NAME`, bench/peers/): the system a user would pick instead, on the same
    model, batch and optimizer, proved to compute the single-process model's function before
    it is timed. Its bytes are its own count of what it hands its collectives (no commfx
    scheduler sees them); the link counters see them as they see commfx's."""

    def __init__(self, spec: PlanSpec, config: BenchConfig, rank: int, world_size: int):
        super().__init__(spec, config, rank)
        from ..models import load_model
        from ..verify import data_share, local_batch
        from .peers import peer_module

        name, options = spec.peer_parts
        module = peer_module(name)
        model, inputs = load_model(config.model, seed=config.seed, **config.model_kwargs)
        ep = spec.plan.topology.expert_parallel_size
        # The check runs a float64 single-process reference of the whole batch it is given: a few
        # rows per rank prove the function without the bench batch's memory.
        check = module.check(model, _first_rows(inputs, CHECK_ROWS_PER_RANK * world_size), ep_size=ep, lr=config.lr, **options)
        if not check.ok:
            raise RuntimeError(f"{spec.passes} is not timed: it does not compute the model's function: {check.line()}")
        self.scheduler = None  # no commfx scheduler: a straggler is slowed by its cgroup only (see config)
        self.samples["peer_check"] = check.line()
        self.samples["peer_bytes"] = []
        # A tensor-parallel peer computes on the whole batch on every rank; the others on a data-parallel share.
        self.shares = (1, 0) if getattr(module, "WHOLE_BATCH", False) else data_share(spec.plan, rank)
        self.example, self.example_digest = inputs, digest(inputs)
        self.inputs = local_batch(inputs, *self.shares)
        self.peer = module.Runner(model, self.inputs, ep_size=ep, lr=config.lr, **options)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()  # bounded by the process group's timeout (the launcher's collective timeout)

    def _blocked_s(self) -> float:
        return 0.0  # the peer does not say how long it waited on communication

    def _start_counting(self) -> None:
        pass

    def _stop_counting(self) -> dict:
        self.samples["peer_bytes"].append(self.peer.step_bytes())
        self.records = list(self.peer.records)  # the real step's, before compute-only records its local copies
        return {}

    def _train_steps(self) -> None:
        for index in range(self.steps_per_round):
            self.peer.inputs = self.batches[index]
            self.peer.train_step()

    def compute_only(self) -> tuple[float, float]:
        """The peer's step with its collectives made local copies of the same size."""
        self.barrier()
        start = time.monotonic()
        for index in range(self.steps_per_round):
            self.peer.inputs = self.batches[index]
            self.peer.compute_only()
        return _per_step(start, time.monotonic(), self.steps_per_round)

    def comm_only(self) -> tuple[float, float]:
        """The collectives of the peer's last real step, replayed alone on buffers of their sizes."""
        from .peers.common import replay

        self.barrier()
        start = time.monotonic()
        for _ in range(self.steps_per_round):
            replay(self.records)
        return _per_step(start, time.monotonic(), self.steps_per_round)

    def traced_round(self, rank: int, trace_dir: str) -> str | None:
        return None  # a peer's collectives are not on commfx's timeline

    def choices(self) -> list[str]:
        """What the peer says about its setup (torch.compile: how long compiling took)."""
        return list(getattr(self.peer, "notes", []))


CHECK_ROWS_PER_RANK = 2


def _first_rows(inputs, rows: int):
    """The first `rows` rows of every tensor of a batch (a tuple, or a dict of keyword tensors)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() else t, inputs)


def _per_step(start: float, end: float, steps: int) -> tuple[float, float]:
    """A span of `steps` steps as the span of one (the same start, a 1/steps share of the time)."""
    return start, start + (end - start) / steps


def _dummy_buffer(record) -> torch.Tensor:
    if record.peer >= 0:  # a point-to-point send or receive
        return torch.zeros((record.send_rows or record.recv_rows)[0], dtype=record.dtype)
    if record.kind == "all_to_all":
        return torch.zeros((sum(record.send_rows), *record.row_shape), dtype=record.dtype)
    return torch.zeros(record.send_rows[0], dtype=record.dtype)


def _report_progress(path: str | None, done: int, total: int, phase: str) -> None:
    """Rank 0 tells the parent how far it is (the parent draws the progress bar)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{done} {total} {phase}\n")
    os.replace(tmp, path)


def bench_worker(rank: int, world_size: int, config: BenchConfig) -> dict:
    """Run on every rank by the launcher: build every plan, then interleaved rounds."""
    progress = config.progress_path if rank == 0 else None
    total = config.warmup + config.steps
    _report_progress(progress, 0, total, "compiling")
    runners = [(_PeerRunner if spec.peer else _PlanRunner)(spec, config, rank, world_size) for spec in config.plans]
    slowdown = RankSlowdown(config.slow, rank)
    for index in range(total):
        phase = "warm-up" if index < config.warmup else "measuring"
        _report_progress(progress, index, total, phase)
        order = runners if index % 2 == 0 else runners[::-1]
        for runner in order:
            runner.round(keep=index >= config.warmup, slowdown=slowdown, slowed=runner.spec.label not in config.healthy)
    _report_progress(progress, total, total, "done")
    for runner in runners:
        runner.samples["decisions"] = runner.decisions()
        runner.samples["choices"] = runner.choices()
        runner.samples["compiled_with"] = runner.compiled_with()
        runner.samples["placement_decisions"] = runner.placement_lines
    if config.trace_dir:
        for runner in runners:
            runner.samples["trace"] = runner.traced_round(rank, config.trace_dir)
    return {runner.spec.label: runner.samples for runner in runners}
