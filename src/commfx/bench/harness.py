"""`commfx bench`: time a plan (and optionally a baseline plan) on an emulated cluster.

Every rank runs :func:`bench_worker`. One *round* runs, for each plan, three things, each
started together on all ranks by a barrier and timed on every rank:

* a **training step** (zero_grad, forward, loss, backward with the gradient all-reduce,
  optimizer step): the wall time;
* the same step with the scheduler in ``local_only`` mode (every collective becomes a
  local copy of the same size): the **compute-only** time;
* the collectives the training step issued, replayed alone in the same order through
  the same scheduler with dummy buffers of the same sizes: the **communication-only**
  time.

Ranks share this machine's monotonic clock, so a step's time is taken across ranks: from
the moment the last rank starts (a barrier releases ranks up to a one-way latency apart)
to the moment the last rank is done. Compute-only steps do not wait on each other, so
theirs is the slowest rank's duration.

Plans alternate order every round (A B, B A, A B, ...), so slow phases of the machine
(other processes, page cache) hit plan and baseline alike, and the per-round ratio of
the two is a paired measurement. Bytes come from the scheduler's exact counters during
the training step, summed over ranks and split into intra- and inter-node by the plan's
topology.

The parent side (:func:`run_bench`) makes the cluster, optionally calibrates it,
launches the ranks with a progress bar, and turns the per-rank samples into a
:class:`BenchResult`, which renders as rich tables and JSON.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from ..plan import Plan
from ..verify import preflight
from .cluster import EmulatedCluster, LinkSpec
from .straggler import RankSlowdown, SlowRank

# Benchmark-sized configurations of built-in models: big enough that compute and
# communication both take milliseconds on the emulated cluster (see benchmarks/RESULTS.md).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt-moe": {
        "num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_experts": 8, "top_k": 2,
        "expert_hidden": 256, "vocab_size": 512, "max_seq": 64, "batch": 32, "seq": 64,
    },
}
TIMING_KINDS = ("wall", "compute", "comm")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PlanSpec:
    """One plan to measure: a label for tables, the --passes text, and the validated plan."""

    label: str
    passes: str
    plan: Plan


@dataclass(frozen=True)
class BenchConfig:
    """Everything a rank needs (pickled to the workers by the launcher)."""

    model: str
    model_kwargs: dict[str, Any]
    plans: tuple[PlanSpec, ...]  # [0] is the plan under test, [1] the baseline if any
    nodes: int
    ranks_per_node: int
    steps: int
    warmup: int
    lr: float = 1e-3
    seed: int = 0
    progress_path: str | None = None
    trace_dir: str | None = None  # after measuring, one traced round per plan: DIR/<label>.rankN.json
    slow_rank: tuple[int, float] | None = None  # --slow-rank R:FACTOR (validated)
    slow_method: str = "auto"
    healthy: tuple[str, ...] = ()  # labels of plans measured without the straggler
    slow: SlowRank | None = None  # how the straggler is made (set by run_bench once it is)
    # Training steps per timed round (each phase is timed over them and divided): with
    # defer_grad_sync one step's gradient traffic overlaps the next step's forward, which a
    # round of one step can not show. Every round ends with the plan's traffic settled.
    steps_per_round: int = 1


# --------------------------------------------------------------------------- worker side


class _PlanRunner:
    """One plan's distributed module on this rank, able to run the three timed phases."""

    def __init__(self, spec: PlanSpec, config: BenchConfig, rank: int, world_size: int):
        from ..api import distribute
        from ..models import load_model
        from ..runtime.pipeline.module import PipelineModule
        from ..verify import data_share, local_batch

        self.spec = spec
        model, inputs = load_model(config.model, seed=config.seed, **config.model_kwargs)
        self.inputs = local_batch(inputs, *data_share(spec.plan, rank))  # a tuple, or a dict of keyword tensors
        self.dm = distribute(model, spec.plan, self.inputs)
        self.pipelined = isinstance(self.dm, PipelineModule)
        self.scheduler = self.dm.scheduler
        self.optimizer = torch.optim.AdamW(self.dm.parameters(), lr=config.lr)
        self.records: list = []
        self.samples: dict[str, list] = {kind: [] for kind in TIMING_KINDS} | {"bytes": [], "own_compute": []}
        self.controller = getattr(self.dm, "straggler", None)  # resize_tp's SEMI controller, if the plan has one
        if self.controller is not None:
            self.controller.attach_optimizer(self.optimizer)  # migrated units move their AdamW state with them
        packing = getattr(self.dm, "packing", None) or {}
        self.replace_every = max((spec["replace_every"] for spec in packing.values()), default=0)
        self.real_steps = 0
        self.placement_lines: list[str] = []  # what each re-placement did (the same on every rank)
        self.steps_per_round = config.steps_per_round
        if getattr(self.dm, "deferred", None) is not None:
            self.dm.deferred.attach(self.optimizer)  # defer_grad_sync: the optimizer catches deferred parameters up

    def _train_step(self) -> None:
        from ..runtime.comm import install_default
        from ..train import loss_fn
        from ..verify import batch_tensors, call

        # Backward comm ops find the process-default scheduler: make it this plan's.
        install_default(self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipelined:
            args, kwargs = ((), self.inputs) if isinstance(self.inputs, dict) else (self.inputs, {})
            self.dm.step(*args, loss_fn=lambda outputs, mb: loss_fn(outputs, mb.inputs), **kwargs)
        else:
            loss_fn(call(self.dm, self.inputs), batch_tensors(self.inputs)).backward()
        self.optimizer.step()

    def step(self) -> tuple[tuple[float, float], dict]:
        """A real training step; records its collectives and exact bytes for this round."""
        self.scheduler.stats.reset()
        self.scheduler.records = []
        self.scheduler.barrier()
        blocked = self.scheduler.blocked_s
        start = time.monotonic()
        self._train_steps()
        span = _per_step(start, time.monotonic(), self.steps_per_round)
        self.own_compute = span[1] - span[0] - (self.scheduler.blocked_s - blocked) / self.steps_per_round  # wall less comm waits
        self.records, self.scheduler.records = self.scheduler.records, None
        stats = {kind: {k: v / self.steps_per_round for k, v in entry.items()} for kind, entry in self.scheduler.stats.as_dict().items()}
        self._replace_experts_when_due()
        return span, stats

    def _train_steps(self) -> None:
        """`steps_per_round` training steps back to back, then every deferred gradient settled."""
        for _ in range(self.steps_per_round):
            self._train_step()
        if not self.pipelined:
            self.dm.synchronize()

    def _replace_experts_when_due(self) -> None:
        """pack_experts:replace_every=N: re-place experts after every N real steps, as a
        training run does (`attach_optimizer`), but outside the timed span and its byte count
        (at most once per round: after the round whose steps reach the next multiple of N),
        and never after the compute-only replay, whose collectives are local copies (ranks
        would decide from different statistics)."""
        before, self.real_steps = self.real_steps, self.real_steps + self.steps_per_round
        if self.replace_every and self.real_steps // self.replace_every > before // self.replace_every:
            for d in self.dm.replace_experts(self.optimizer):
                self.placement_lines.append(
                    f"after step {self.real_steps}: {d.op_id} moved {d.moved} experts, co-located selections "
                    f"{d.colocated_before:.0f} -> {d.colocated_after:.0f}, max load {d.max_load:.0f} (bound {d.bound:.0f})")

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

        self.dm.timeline, self.scheduler.dispatcher.history = Timeline(rank), []
        try:
            self.scheduler.barrier()
            for index in range(self.steps_per_round):
                start = time.perf_counter()
                self._train_step()
                self.dm.timeline.step(index, start, time.perf_counter())
            if not self.pipelined:
                self.dm.synchronize()
            path = rank_trace_path(Path(trace_dir) / f"{self.spec.label}.json", rank)
            return str(self.dm.timeline.write(path, self.scheduler.dispatcher.history))
        finally:
            self.dm.timeline, self.scheduler.dispatcher.history = None, None

    def round(self, keep: bool, slowdown: RankSlowdown, slowed: bool) -> None:
        """Run the three phases once (this rank slowed if it is the straggler and the plan is
        not a healthy reference); keep the samples unless this is warm-up."""
        with slowdown.applied(self.scheduler, active=slowed):
            wall, nbytes = self.step()
            compute = self.compute_only()
        comm = self.comm_only()
        if keep:
            for kind, value in zip(TIMING_KINDS, (wall, compute, comm)):
                self.samples[kind].append(value)
            self.samples["bytes"].append(nbytes)
            self.samples["own_compute"].append(self.own_compute)

    def decisions(self) -> list[str]:
        """What resize_tp's controller did (the same on every rank)."""
        if self.controller is None:
            return []
        return [d.line() for d in self.controller.decisions if d.action != "keep"]


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
    runners = [_PlanRunner(spec, config, rank, world_size) for spec in config.plans]
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
        runner.samples["placement_decisions"] = runner.placement_lines
    if config.trace_dir:
        for runner in runners:
            runner.samples["trace"] = runner.traced_round(rank, config.trace_dir)
    return {runner.spec.label: runner.samples for runner in runners}


# --------------------------------------------------------------------------- results


@dataclass
class Timing:
    """Per-step seconds (of the whole cluster) and their median and spread."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def quantile(self, q: float) -> float:
        values = sorted(self.samples)
        if len(values) == 1:
            return values[0]
        position = q * (len(values) - 1)
        low = int(position)
        high = min(low + 1, len(values) - 1)
        return values[low] + (values[high] - values[low]) * (position - low)

    def as_dict(self) -> dict:
        return {
            "median_s": self.median, "p25_s": self.quantile(0.25), "p75_s": self.quantile(0.75),
            "min_s": min(self.samples), "max_s": max(self.samples), "samples_s": self.samples,
        }


@dataclass
class PlanResult:
    label: str
    passes: str
    wall: Timing
    compute: Timing
    comm: Timing
    bytes: dict[str, dict[str, float]]  # kind -> calls / intra_node_bytes / inter_node_bytes, per step, all ranks
    rank_compute: list[Timing] = field(default_factory=list)  # per rank: its own compute-only step time
    rank_own_compute: list[Timing] = field(default_factory=list)  # per rank: training step less its comm waits
    slowed: bool = False  # the straggler (if any) was slow in this plan
    decisions: list[str] = field(default_factory=list)  # resize_tp's decisions (rank 0's; every rank's are the same)
    placement_decisions: list[str] = field(default_factory=list)  # pack_experts re-placements (rank 0's)

    @property
    def bound(self) -> float:
        """Perfect-overlap bound: a step can not be faster than its compute or its comm."""
        return max(self.compute.median, self.comm.median)

    def total(self, key: str) -> float:
        return sum(entry[key] for entry in self.bytes.values())

    def as_dict(self) -> dict:
        return {
            "label": self.label, "passes": self.passes,
            "wall": self.wall.as_dict(), "compute_only": self.compute.as_dict(), "comm_only": self.comm.as_dict(),
            "overlap_bound_s": self.bound,
            "bytes_per_step": self.bytes,
            "intra_node_bytes_per_step": self.total("intra_node_bytes"),
            "inter_node_bytes_per_step": self.total("inter_node_bytes"),
            "rank_compute_only_median_s": [t.median for t in self.rank_compute],
            "rank_step_compute_median_s": [t.median for t in self.rank_own_compute],
            "straggler_slowed": self.slowed, "resize_tp_decisions": self.decisions,
            "expert_placement_decisions": self.placement_decisions,
        }


@dataclass
class BenchResult:
    model: str
    model_kwargs: dict[str, Any]
    nodes: int
    ranks_per_node: int
    link: str | None
    emulated: bool
    cluster: str  # EmulatedCluster.describe()
    fallback_reason: str
    steps: int
    warmup: int
    plans: list[PlanResult]
    steps_per_round: int = 1
    paired_wall_ratio: Timing | None = None  # per-round plan wall / baseline wall
    calibration: dict | None = None
    machine: dict = field(default_factory=dict)
    date: str = ""
    straggler: dict | None = None  # SlowRank.as_dict(): who was slow, by how much, how

    @property
    def baseline(self) -> PlanResult | None:
        return self.plans[1] if len(self.plans) > 1 else None

    def ratios(self) -> dict[str, float] | None:
        """plan ÷ baseline for every headline number (< 1: the plan needs less)."""
        if self.baseline is None:
            return None
        plan, base = self.plans[0], self.baseline
        values = {
            "wall": (plan.wall.median, base.wall.median),
            "compute_only": (plan.compute.median, base.compute.median),
            "comm_only": (plan.comm.median, base.comm.median),
            "overlap_bound": (plan.bound, base.bound),
            "inter_node_bytes": (plan.total("inter_node_bytes"), base.total("inter_node_bytes")),
            "intra_node_bytes": (plan.total("intra_node_bytes"), base.total("intra_node_bytes")),
        }
        return {k: (a / b if b else float("nan")) for k, (a, b) in values.items()}

    def wall_ratios(self) -> dict[str, dict[str, float]] | None:
        """Per plan: wall ÷ baseline wall, and wall ÷ the baseline's perfect-overlap bound."""
        base = self.baseline
        if base is None:
            return None
        return {
            p.label: {"wall_over_baseline_wall": p.wall.median / base.wall.median,
                      "wall_over_baseline_bound": p.wall.median / base.bound,
                      "wall_over_own_bound": p.wall.median / p.bound}
            for p in self.plans
        }

    def as_dict(self) -> dict:
        out = {
            "model": self.model, "model_kwargs": self.model_kwargs,
            "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "world_size": self.nodes * self.ranks_per_node,
            "inter_node_link": self.link, "emulated": self.emulated, "cluster": self.cluster,
            "fallback_reason": self.fallback_reason, "steps": self.steps, "warmup": self.warmup,
            "steps_per_round": self.steps_per_round,
            "plans": [p.as_dict() for p in self.plans],
            "ratios_plan_over_baseline": self.ratios(),
            "wall_over_baseline": self.wall_ratios(),
            "paired_wall_ratio": self.paired_wall_ratio.as_dict() if self.paired_wall_ratio else None,
            "calibration": self.calibration, "machine": self.machine, "date": self.date,
            "straggler": self.straggler,
        }
        return out


def summarise(rank_samples: list[dict], config: BenchConfig, cluster, link: LinkSpec | None) -> BenchResult:
    """Per-rank samples -> one result: slowest rank per step, bytes summed over ranks."""
    plans = []
    for spec in config.plans:
        per_rank = [samples[spec.label] for samples in rank_samples]
        timings = {kind: Timing(_cluster_times([r[kind] for r in per_rank], kind)) for kind in TIMING_KINDS}
        plans.append(PlanResult(
            spec.label, spec.passes, timings["wall"], timings["compute"], timings["comm"],
            _bytes_per_step([r["bytes"] for r in per_rank]),
            rank_compute=[Timing([end - start for start, end in r["compute"]]) for r in per_rank],
            rank_own_compute=[Timing(r["own_compute"]) for r in per_rank],
            slowed=config.slow is not None and spec.label not in config.healthy,
            decisions=per_rank[0].get("decisions", []),
            placement_decisions=per_rank[0].get("placement_decisions", []),
        ))
    paired = None
    if len(plans) > 1:
        paired = Timing([a / b for a, b in zip(plans[0].wall.samples, plans[1].wall.samples)])
    return BenchResult(
        model=config.model, model_kwargs=config.model_kwargs, nodes=cluster.nodes,
        ranks_per_node=cluster.ranks_per_node, link=str(link) if link else None, emulated=cluster.emulated,
        cluster=cluster.describe(), fallback_reason=cluster.reason, steps=config.steps, warmup=config.warmup,
        steps_per_round=config.steps_per_round, plans=plans, paired_wall_ratio=paired, machine=machine_info(),
        date=_dt.date.today().isoformat(), straggler=config.slow.as_dict() if config.slow else None,
    )


def _cluster_times(per_rank_spans: list[list[tuple[float, float]]], kind: str) -> list[float]:
    """Per step: last start to last end for phases that communicate, else the slowest rank."""
    times = []
    for spans in zip(*per_rank_spans):
        if kind == "compute":
            times.append(max(end - start for start, end in spans))
        else:
            times.append(max(end for _, end in spans) - max(start for start, _ in spans))
    return times


def _bytes_per_step(per_rank_steps: list[list[dict]]) -> dict[str, dict[str, float]]:
    """Mean over steps of the bytes all ranks sent, per collective kind (exact integers
    whenever every step sends the same, as in capacity mode)."""
    steps = len(per_rank_steps[0])
    totals: dict[str, dict[str, int]] = {}
    for rank_steps in per_rank_steps:
        for step in rank_steps:
            for kind, entry in step.items():
                slot = totals.setdefault(kind, {"calls": 0, "intra_node_bytes": 0, "inter_node_bytes": 0})
                for key in slot:
                    slot[key] += entry[key]
    return {kind: {key: _exact_mean(value, steps) for key, value in slot.items()} for kind, slot in sorted(totals.items())}


def _exact_mean(total: int, count: int) -> float | int:
    return total // count if total % count == 0 else total / count


def machine_info() -> dict:
    return {
        "cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__, "backend": "gloo (CPU)",
    }


# --------------------------------------------------------------------------- parent side


class _LocalhostCluster(EmulatedCluster):
    """The cluster's own localhost fallback, chosen on purpose (``--no-emulation``)."""

    def _preflight(self) -> str:
        return "emulation disabled (--no-emulation)"


def make_cluster(nodes: int, ranks_per_node: int, link: LinkSpec | None, *, emulate: bool = True) -> EmulatedCluster:
    cls = EmulatedCluster if emulate else _LocalhostCluster
    return cls(nodes, ranks_per_node, link, allow_fallback=True)


def calibrate(cluster, link: LinkSpec | None) -> dict:
    """Measure compute rate and link, and say what FLOPs-per-byte balance the link gives.

    The balance that decides whether communication is exposed is FLOP/s per rank over
    inter-node bytes/s per rank; GPU clusters sit at ~1e3..1e4 (see
    :func:`commfx.bench.calibrate.suggest_rate`). Ranks share this machine's cores, so
    each gets ``rate / world_size``; the ranks of a node share its link.
    """
    from .calibrate import GPU_FLOPS_PER_BYTE_RANGE, format_rate, measure_compute_rate, measure_link

    machine_flops = measure_compute_rate(seconds=0.5)
    per_rank_flops = machine_flops / cluster.world_size
    measured = measure_link(cluster, timeout=60.0)
    out: dict[str, Any] = {
        "machine_flops": machine_flops, "per_rank_flops": per_rank_flops, "link": measured,
        "gpu_flops_per_byte_range": list(GPU_FLOPS_PER_BYTE_RANGE),
    }

    def balance(node_bits: float) -> float:
        return per_rank_flops / (node_bits / 8 / cluster.ranks_per_node)

    if link is not None:
        out["flops_per_byte_at_set_rate"] = balance(link.rate_bits)
    if measured.get("inter"):
        out["flops_per_byte_at_measured_rate"] = balance(measured["inter"]["throughput_bits"])
    out["rate_for_flops_per_byte"] = {
        f"{target:g}": format_rate(per_rank_flops / target * 8 * cluster.ranks_per_node) for target in (1e3, 3e3, 1e4)
    }
    return out


def _watch_progress(path: Path, console, stop: threading.Event) -> None:
    """Draw rank 0's progress (it writes 'done total phase' to `path`) until `stop`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("starting ranks", total=None)
        while not stop.wait(0.2):
            try:
                done, total, phase = path.read_text().split()
            except (OSError, ValueError):
                continue
            progress.update(task, completed=int(done), total=int(total), description=f"rounds ({phase})")


def launch_ranks(cluster, config: BenchConfig, *, console, timeout_s: float) -> list[dict]:
    """Start one rank per emulated slot (inside its node's namespace) and wait, drawing progress."""
    from ..runtime.launcher import RankEnvironment, launch

    def environment(rank: int) -> RankEnvironment:
        spec = cluster.rank_launch(rank)
        return RankEnvironment(prefix=list(spec.prefix), env=dict(spec.env))

    with tempfile.TemporaryDirectory(prefix="commfx-bench-") as tmp:
        progress_path = Path(tmp) / "progress"
        config = dataclasses.replace(config, progress_path=str(progress_path))
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_progress, args=(progress_path, console, stop), daemon=True)
        watcher.start()
        try:
            return launch(
                "commfx.bench.harness:bench_worker", cluster.world_size, {"config": config},
                timeout_s=timeout_s, collective_timeout_s=max(spec.plan.collective_timeout_s for spec in config.plans),
                rank_environment=environment, master_addr=cluster.master_addr, master_port=cluster.suggest_port(),
            )
        finally:
            stop.set()
            watcher.join(timeout=5)


def build_config(model: str, passes: str, vs: str | None, *, nodes: int, ranks_per_node: int, ep: int = 0, pp: int = 1,
                 model_kwargs: dict[str, Any] | None = None, steps: int = 10, warmup: int = 2, steps_per_round: int = 1,
                 lr: float = 1e-3, seed: int = 0, also: list[tuple[str, str]] | None = None,
                 link: LinkSpec | None = None, flops_per_rank: float | None = None,
                 grad_bucket_bytes: int | None = None, collective_overhead_s: float | None = None,
                 collective_timeout_s: float | None = None, tp: int = 1, slow_rank: tuple[int, float] | None = None,
                 slow_method: str = "auto", healthy: tuple[str, ...] = ()) -> BenchConfig:
    """Validate every plan against the model before any rank starts.

    Plans: the one under test ("plan"), the baseline (`vs`, "baseline") and any `also`
    (label, passes) pairs, all interleaved. The link and compute figures go into each
    plan's topology, where cost models (partition_a2a k=auto) read them. `slow_rank`
    (rank, factor) makes that rank a straggler in every plan but the `healthy` ones.
    """
    from ..models import load_model
    from .straggler import check_request

    kwargs = {**PRESETS.get(model, {}), **(model_kwargs or {})}
    world = nodes * ranks_per_node
    figures: dict[str, float] = {}
    if link is not None:
        figures["inter_node_bandwidth"] = link.rate_bits / 8
        figures["inter_node_latency_s"] = link.latency_s
    if flops_per_rank:
        figures["flops_per_s"] = flops_per_rank
    if collective_overhead_s is not None:
        figures["collective_overhead_s"] = collective_overhead_s

    def spec(label: str, text: str) -> PlanSpec:
        plan = Plan.from_cli(text, world_size=world, ep=ep, pp=pp, tp=tp, ranks_per_node=ranks_per_node, **figures)
        if grad_bucket_bytes:
            plan = dataclasses.replace(plan, grad_bucket_bytes=grad_bucket_bytes)
        if collective_timeout_s:
            plan = dataclasses.replace(plan, collective_timeout_s=collective_timeout_s)
        return PlanSpec(label, text, plan)

    specs = [spec("plan", passes)]
    if vs is not None:
        specs.append(spec("baseline", vs))
    specs.extend(spec(label, text) for label, text in (also or []))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"plan labels must be distinct, got {labels} (plan and baseline are taken)")
    unknown = [label for label in healthy if label not in labels]
    if unknown:
        raise ValueError(f"--healthy {', '.join(unknown)}: no plan has that label (the plans are {', '.join(labels)})")
    if healthy and slow_rank is None:
        raise ValueError("--healthy names plans to run without the straggler; it needs --slow-rank R:FACTOR")
    if slow_rank is not None:
        check_request(*slow_rank, world, slow_method)
    for s in specs:  # every plan compiles here first: errors surface once, before ranks start
        model_module, inputs = load_model(model, seed=seed, **kwargs)
        preflight(model_module, s.plan, inputs)
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    return BenchConfig(model, kwargs, tuple(specs), nodes, ranks_per_node, steps=steps, warmup=warmup, lr=lr, seed=seed,
                       slow_rank=slow_rank, slow_method=slow_method, healthy=tuple(healthy), steps_per_round=steps_per_round)


def run_bench(config: BenchConfig, *, link: LinkSpec | None, emulate: bool = True, calibrate_first: bool = False,
              console=None, timeout_s: float = 600.0) -> BenchResult:
    """Make the cluster, calibrate if asked, run the ranks, summarise; the cluster is gone after."""
    from rich.console import Console

    from .straggler import cleanup, prepare

    console = console or Console(highlight=False)
    if config.slow_rank is not None:
        config = dataclasses.replace(config, slow=prepare(*config.slow_rank, config.nodes * config.ranks_per_node, config.slow_method))
    try:
        return _run_on_cluster(config, link, emulate, calibrate_first, console, timeout_s)
    finally:
        cleanup(config.slow)


def _run_on_cluster(config: BenchConfig, link, emulate: bool, calibrate_first: bool, console, timeout_s: float) -> BenchResult:
    with make_cluster(config.nodes, config.ranks_per_node, link, emulate=emulate) as cluster:
        console.print(f"cluster: {cluster.describe()}", markup=False)
        if config.slow is not None:
            healthy = f" (not in {', '.join(config.healthy)})" if config.healthy else ""
            console.print(config.slow.describe() + healthy, markup=False)
        if not cluster.emulated:
            console.print(f"[yellow]warning:[/yellow] no emulated network ({escape(cluster.reason)}); "
                          "ranks talk over plain localhost, so link rate and latency are NOT applied")
        calibration = None
        if calibrate_first:
            calibration = calibrate(cluster, link)
            console.print(calibration_table(calibration))
        samples = launch_ranks(cluster, config, console=console, timeout_s=timeout_s)
        result = summarise(samples, config, cluster, link)
        if config.trace_dir:
            from ..runtime.trace import merge_traces

            for spec in config.plans:
                merged = merge_traces([r[spec.label]["trace"] for r in samples], Path(config.trace_dir) / f"{spec.label}.json")
                console.print(f"trace of one {spec.label} round: {merged}", markup=False)
    result.calibration = calibration
    return result


# --------------------------------------------------------------------------- rendering


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _spread(t: Timing) -> str:
    """Median, and the interquartile range on a second, dim line."""
    return f"{_ms(t.median)}\n[dim]{_ms(t.quantile(0.25))}–{_ms(t.quantile(0.75))}[/dim]"


def _bytes(n: float) -> str:
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"


def _passes_text(passes: str) -> str:
    return escape(passes) if passes else '"" (plain data parallel)'


def timing_table(result: BenchResult):
    from rich.table import Table

    caption = "; ".join(f"{p.label}: {_passes_text(p.passes)}" for p in result.plans)
    table = Table(title=f"{result.model}: ms per step, median and p25–p75 of {result.steps} steps", caption=caption)
    table.add_column("plan")
    for name in ("wall", "compute-only", "comm-only", "max(comp, comm)", "wall ÷ max"):
        table.add_column(name, justify="right")
    for p in result.plans:
        table.add_row(p.label, _spread(p.wall), _spread(p.compute), _spread(p.comm), _ms(p.bound),
                      f"{p.wall.median / p.bound:.2f}")
    base = result.baseline
    if base is not None:
        for p in result.plans:
            if p is base:
                continue
            table.add_row(f"{p.label} ÷ baseline", f"{p.wall.median / base.wall.median:.2f}",
                          f"{p.compute.median / base.compute.median:.2f}", f"{p.comm.median / base.comm.median:.2f}",
                          f"{p.bound / base.bound:.2f}", f"{p.wall.median / base.bound:.2f} of baseline's", style="bold")
    return table


def bytes_table(result: BenchResult):
    from rich.table import Table

    table = Table(title="bytes per step, all ranks (exact counts from the comm scheduler)")
    for name, justify in (("plan", "left"), ("collective", "left"), ("calls", "right"),
                          ("intra-node B", "right"), ("inter-node B", "right")):
        table.add_column(name, justify=justify)
    for p in result.plans:
        for kind, entry in p.bytes.items():
            table.add_row(p.label, kind, _bytes(entry["calls"]), _bytes(entry["intra_node_bytes"]),
                          _bytes(entry["inter_node_bytes"]))
        table.add_row(p.label, "total", "", _bytes(p.total("intra_node_bytes")), _bytes(p.total("inter_node_bytes")),
                      style="bold", end_section=True)
    return table


def calibration_table(calibration: dict):
    from rich.table import Table

    table = Table(title="calibration", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("compute (float32 matmul, whole machine)", f"{calibration['machine_flops'] / 1e9:.1f} GFLOP/s")
    table.add_row("compute per rank (ranks share the cores)", f"{calibration['per_rank_flops'] / 1e9:.2f} GFLOP/s")
    for where in ("inter", "intra"):
        probe = calibration["link"].get(where)
        if probe:
            table.add_row(f"{where}-node link, ranks {tuple(probe['ranks'])}",
                          f"{probe['throughput_bits'] / 1e6:,.0f} Mbit/s, rtt {probe['rtt_s'] * 1e3:.2f} ms")
    lo, hi = calibration["gpu_flops_per_byte_range"]
    for key, label in (("flops_per_byte_at_set_rate", "FLOPs per inter-node byte at the set rate"),
                       ("flops_per_byte_at_measured_rate", "FLOPs per inter-node byte at the measured rate")):
        if key in calibration:
            value = calibration[key]
            verdict = "GPU-like" if lo <= value <= hi else ("comm cheaper than on GPUs" if value < lo else "comm dearer than on GPUs")
            table.add_row(label, f"{value:,.0f}: {verdict} (GPU clusters {lo:g}–{hi:g})")
    for target, rate in calibration["rate_for_flops_per_byte"].items():
        table.add_row(f"link rate giving {float(target):g} FLOPs/byte", rate)
    return table


def straggler_table(result: BenchResult):
    """Every rank's own compute per plan: where the straggler is, and what resize_tp did."""
    from rich.table import Table

    table = Table(title=f"per-rank compute, ms (median): {escape(result.straggler['describe'])}")
    table.add_column("plan")
    table.add_column("straggler")
    for kind in ("compute-only step", "training step less comm waits"):
        table.add_column(kind, justify="right")
    for p in result.plans:
        table.add_row(p.label, "slow" if p.slowed else "healthy",
                      " / ".join(_ms(t.median) for t in p.rank_compute), " / ".join(_ms(t.median) for t in p.rank_own_compute))
    return table


def render(result: BenchResult, console) -> None:
    """Print the tables and the paired ratio (what the interleaving buys)."""
    console.print(timing_table(result))
    console.print(bytes_table(result))
    if result.straggler is not None:
        console.print(straggler_table(result))
        for p in result.plans:
            for line in p.decisions:
                console.print(f"{p.label}: resize_tp {line}", markup=False)
    for p in result.plans:
        for line in p.placement_decisions:
            console.print(f"{p.label}: pack_experts re-placed {line}", markup=False)
    if result.paired_wall_ratio is not None:
        r = result.paired_wall_ratio
        console.print(
            f"paired wall ratio plan ÷ baseline (same round, interleaved): median {r.median:.2f}, "
            f"p25–p75 {r.quantile(0.25):.2f}–{r.quantile(0.75):.2f}, min–max {min(r.samples):.2f}–{max(r.samples):.2f}"
        )
    if not result.emulated:
        console.print(f"[yellow]not emulated:[/yellow] {escape(result.fallback_reason)}")
