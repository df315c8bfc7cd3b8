"""`commfx bench`: time a plan (and optionally a baseline plan) on an emulated cluster.

This module is the parent side; the rest of the bench is one module per concern:
:mod:`.config` (the plans, validated before any rank starts), :mod:`.worker` (what each
rank runs), :mod:`.results` (samples summarised into a :class:`BenchResult`, the JSON) and
:mod:`.render` (rich tables).

Every rank runs :func:`~commfx.bench.worker.bench_worker`. One *round* runs, for each plan, three things, each
started together on all ranks by a barrier and timed on every rank:

* a **training step** (zero_grad, forward, loss, backward with the gradient all-reduce,
  optimizer step, and after every N-th optimizer step of `pack_experts:replace_every=N`
  the expert re-placement a training run does: statistics all-reduced, moved experts sent
  point to point): the wall time, with every byte of it counted;
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
topology; beside them, the bytes that really crossed each node's link in the same span
(the link's own counters, read on each node before the step and after a barrier that
follows it: :mod:`commfx.bench.wire`), which give the wire bound.

The parent side (:func:`run_bench`) makes the cluster, optionally calibrates it,
launches the ranks with a progress bar, and turns the per-rank samples into a
:class:`~commfx.bench.results.BenchResult`, which renders as rich tables and JSON.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from .cluster import EmulatedCluster
from .config import BenchConfig
from .links import LinkSpec
from .render import calibration_table
from .results import BenchResult, summarise


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


def _read_progress(path: Path) -> tuple[int, int, str] | None:
    """Rank 0's last 'done total phase' line, or None before it writes one."""
    try:
        done, total, phase = path.read_text().split()
        return int(done), int(total), phase
    except (OSError, ValueError):
        return None


def _watch_progress(path: Path, console, stop: threading.Event) -> None:
    """Show rank 0's progress until `stop`: a bar on a terminal, else one line per round
    (a log or a pipe gets them as they come, with the seconds since the ranks started)."""
    if not console.is_terminal:
        start, last = time.monotonic(), None
        while not stop.wait(0.5):
            state = _read_progress(path)
            if state is not None and state != last:
                done, total, phase = last = state
                what = "compiling every plan" if phase == "compiling" else f"round {done + 1}/{total} ({phase})" if done < total else "done"
                console.print(f"bench: {what}, {time.monotonic() - start:.0f} s", markup=False, highlight=False)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("starting ranks", total=None)
        while not stop.wait(0.2):
            state = _read_progress(path)
            if state is not None:
                done, total, phase = state
                progress.update(task, completed=done, total=total, description=f"rounds ({phase})")


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
                "commfx.bench.worker:bench_worker", cluster.world_size, {"config": config},
                timeout_s=timeout_s, collective_timeout_s=max(spec.plan.collective_timeout_s for spec in config.plans),
                rank_environment=environment, master_addr=cluster.master_addr, master_port=cluster.suggest_port(),
            )
        finally:
            stop.set()
            watcher.join(timeout=5)


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
        config = dataclasses.replace(config, link_devices=cluster.link_devices())
        samples = launch_ranks(cluster, config, console=console, timeout_s=timeout_s)
        result = summarise(samples, config, cluster, link)
        if config.trace_dir:
            from ..runtime.trace import merge_traces

            for spec in config.plans:
                if spec.peer:
                    console.print(f"{spec.label}: a peer, not traced (its collectives are not on commfx's timeline)", markup=False)
                    continue
                merged = merge_traces([r[spec.label]["trace"] for r in samples], Path(config.trace_dir) / f"{spec.label}.json")
                console.print(f"trace of one {spec.label} round: {merged}", markup=False)
    result.calibration = calibration
    return result
