"""What a `commfx bench` run found: per-rank samples summarised into timings of the whole
cluster (:class:`Timing`), one :class:`PlanResult` per plan and the :class:`BenchResult`,
which is what the JSON holds and the tables render."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import BenchConfig
from .links import LinkSpec
from .wire import AGREEMENT_TOLERANCE, wire_bound

TIMING_KINDS = ("wall", "compute", "comm")
WIRE_COUNTERS = ("tx/rx bytes of the node end of each node's veth (/proc/net/dev in its namespace), read between "
                 "two barriers before a training step and after a barrier that follows it")


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
    choices: list[str] = field(default_factory=list)  # the measured machine and cost-model choices (rank 0's)
    compiled_with: dict | None = None  # cost-model figures and automatic choices (worker's `compiled_with`; rank 0's)
    # Per node: its link device and, per measured round, the (tx, rx) bytes per step its link
    # counters saw; None where there is no link to count (one node, plain localhost).
    wire: list[dict] | None = None
    messages: float = 0.0  # node-crossing collectives per step in the longest lane of any rank
    peer_check: str | None = None  # a peer's equality check against the single-process model
    peer_bytes: dict[str, float] = field(default_factory=dict)  # a peer's own count: payload bytes per step, all ranks
    link: LinkSpec | None = None  # the inter-node link the cluster set (rate and latency of the wire bound)
    layout: dict[str, int] = field(default_factory=dict)  # the plan's pp, tp and ep sizes (what `commfx simulate` lays out)
    same_rounds: bool = True  # measured in the same interleaved rounds as every other plan of the run (bench_worker)

    @property
    def replay_bound(self) -> float:
        """max(compute-only, the step's collectives replayed alone): a diagnostic, not a
        bound (the replay gets faster with smaller chunks of the same bytes)."""
        return max(self.compute.median, self.comm.median)

    def total(self, key: str) -> float:
        return sum(entry[key] for entry in self.bytes.values())

    def wire_per_node(self) -> list[dict] | None:
        """Per node: mean bytes per step its link sent (tx) and received (rx)."""
        if self.wire is None:
            return None
        return [{"node": n["node"], "device": n["device"],
                 "tx_bytes": statistics.fmean(tx for tx, _ in n["samples"]),
                 "rx_bytes": statistics.fmean(rx for _, rx in n["samples"])} for n in self.wire]

    @property
    def busiest_link_bytes(self) -> float | None:
        """Bytes per step in the busiest direction of the busiest node's link."""
        nodes = self.wire_per_node()
        return None if nodes is None else max(max(n["tx_bytes"], n["rx_bytes"]) for n in nodes)

    @property
    def wire_sent_bytes(self) -> float | None:
        """Bytes per step all links carried (what every node sent: the scheduler's
        inter-node count plus headers, acknowledgements and gloo's framing)."""
        nodes = self.wire_per_node()
        return None if nodes is None else sum(n["tx_bytes"] for n in nodes)

    @property
    def wire_over_scheduler(self) -> float | None:
        sent, counted = self.wire_sent_bytes, self.total("inter_node_bytes")
        return None if sent is None or not counted else sent / counted

    @property
    def wire_agrees(self) -> bool | None:
        """Wire bytes within AGREEMENT_TOLERANCE of the scheduler's inter-node count."""
        ratio = self.wire_over_scheduler
        return None if ratio is None else abs(ratio - 1) <= AGREEMENT_TOLERANCE

    @property
    def wire_bound(self) -> float | None:
        """max(compute-only, busiest link's wire bytes ÷ link rate + messages × latency);
        None without wire bytes or without a set link rate (``--inter-node none``)."""
        busiest = self.busiest_link_bytes
        if busiest is None or self.link is None:
            return None
        return wire_bound(self.compute.median, busiest, self.link.rate_bits, self.messages, self.link.latency_s)

    def wire_dict(self) -> dict | None:
        nodes = self.wire_per_node()
        if nodes is None:
            return None
        return {
            "per_node": nodes, "busiest_link_bytes": self.busiest_link_bytes, "sent_bytes": self.wire_sent_bytes,
            "scheduler_inter_node_bytes": self.total("inter_node_bytes"), "wire_over_scheduler": self.wire_over_scheduler,
            "agrees_within": AGREEMENT_TOLERANCE, "agrees": self.wire_agrees,
            "samples": [{"node": n["node"], "tx_rx_bytes": n["samples"]} for n in self.wire],
        }

    def as_dict(self) -> dict:
        return {
            "label": self.label, "passes": self.passes, "layout": self.layout or None,
            "peer": self.passes.startswith("peer:"), "same_rounds": self.same_rounds,
            "wall": self.wall.as_dict(), "compute_only": self.compute.as_dict(), "comm_only": self.comm.as_dict(),
            "replay_bound_s": self.replay_bound, "wire_bound_s": self.wire_bound,
            "bytes_per_step": self.bytes,
            "intra_node_bytes_per_step": self.total("intra_node_bytes"),
            "inter_node_bytes_per_step": self.total("inter_node_bytes"),
            "wire_bytes_per_step": self.wire_dict(), "wire_messages_per_step": self.messages,
            "peer_check": self.peer_check, "peer_payload_bytes_per_step": self.peer_bytes or None,
            "rank_compute_only_median_s": [t.median for t in self.rank_compute],
            "rank_step_compute_median_s": [t.median for t in self.rank_own_compute],
            "straggler_slowed": self.slowed, "resize_tp_decisions": self.decisions,
            "expert_placement_decisions": self.placement_decisions, "choices": self.choices, "compiled_with": self.compiled_with,
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
    # Per other plan (baseline and every --also): per-round plan wall / its wall, same rounds.
    paired_wall_ratios: dict[str, Timing] = field(default_factory=dict)
    calibration: dict | None = None
    machine: dict = field(default_factory=dict)
    date: str = ""
    straggler: dict | None = None  # SlowRank.as_dict(): who was slow, by how much, how
    run: dict | None = None  # run_record.RunRecorder.finish(): commit, command, load, proportions
    batches: dict | None = None  # what the plans trained on (`_batches`)

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
            "replay_bound": (plan.replay_bound, base.replay_bound),
            "wire_bound": (plan.wire_bound, base.wire_bound),
            "inter_node_bytes": (plan.total("inter_node_bytes"), base.total("inter_node_bytes")),
            "intra_node_bytes": (plan.total("intra_node_bytes"), base.total("intra_node_bytes")),
            "busiest_link_wire_bytes": (plan.busiest_link_bytes, base.busiest_link_bytes),
        }
        return {k: _ratio(a, b) for k, (a, b) in values.items()}

    def wall_ratios(self) -> dict[str, dict[str, float | None]] | None:
        """Per plan: wall ÷ baseline wall, and wall ÷ the wire bounds (the headline; None where
        there is no wire bound) and ÷ the replay bounds (a diagnostic)."""
        base = self.baseline
        if base is None:
            return None
        return {
            p.label: {"wall_over_baseline_wall": p.wall.median / base.wall.median,
                      "wall_over_own_wire_bound": _ratio(p.wall.median, p.wire_bound),
                      "wall_over_baseline_wire_bound": _ratio(p.wall.median, base.wire_bound),
                      "wall_over_own_replay_bound": p.wall.median / p.replay_bound,
                      "wall_over_baseline_replay_bound": p.wall.median / base.replay_bound}
            for p in self.plans
        }

    def as_dict(self) -> dict:
        link = LinkSpec.parse(self.link) if self.link else None
        out = {
            "model": self.model, "model_kwargs": self.model_kwargs,
            "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "world_size": self.nodes * self.ranks_per_node,
            "inter_node_link": self.link, "emulated": self.emulated, "cluster": self.cluster,
            "fallback_reason": self.fallback_reason, "steps": self.steps, "warmup": self.warmup,
            "steps_per_round": self.steps_per_round,
            "inter_node_rate_bits": link.rate_bits if link else None, "inter_node_latency_s": link.latency_s if link else None,
            "wire_counters": WIRE_COUNTERS if any(p.wire is not None for p in self.plans) else None,
            "plans": [p.as_dict() for p in self.plans],
            "ratios_plan_over_baseline": self.ratios(),
            "wall_over_baseline": self.wall_ratios(),
            "paired_wall_ratio": self.paired_wall_ratio.as_dict() if self.paired_wall_ratio else None,
            "paired_wall_ratios": {label: t.as_dict() for label, t in self.paired_wall_ratios.items()},
            "calibration": self.calibration, "machine": self.machine, "date": self.date,
            "straggler": self.straggler, "run": self.run, "batches": self.batches,
        }
        return out


def _layout(plan) -> dict[str, int]:
    t = plan.topology
    return {"pp": t.pp, "tp": t.tp, "ep": t.expert_parallel_size, "precision": plan.precision, "compute": plan.compute}


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
            choices=per_rank[0].get("choices", []),
            compiled_with=per_rank[0].get("compiled_with"),
            wire=_wire_per_node(per_rank, config.ranks_per_node),
            messages=max(statistics.fmean(r["messages"]) if r.get("messages") else 0.0 for r in per_rank),
            peer_check=per_rank[0].get("peer_check"),
            peer_bytes=_peer_bytes([r.get("peer_bytes", []) for r in per_rank]),
            link=link,
            layout={} if spec.peer else _layout(spec.plan),
        ))
    # The plan's wall over each other plan's in the same round (a paired measurement: load
    # from other processes falls on both), summarised by the median of those ratios.
    paired_all = {p.label: Timing([a / b for a, b in zip(plans[0].wall.samples, p.wall.samples)]) for p in plans[1:]}
    paired = paired_all.get(plans[1].label) if len(plans) > 1 else None
    return BenchResult(
        model=config.model, model_kwargs=config.model_kwargs, nodes=cluster.nodes,
        ranks_per_node=cluster.ranks_per_node, link=str(link) if link else None, emulated=cluster.emulated,
        cluster=cluster.describe(), fallback_reason=cluster.reason, steps=config.steps, warmup=config.warmup,
        steps_per_round=config.steps_per_round, plans=plans, paired_wall_ratio=paired, paired_wall_ratios=paired_all,
        machine=machine_info(),
        date=_dt.date.today().isoformat(), straggler=config.slow.as_dict() if config.slow else None,
        batches=_batches(rank_samples, config),
    )


def _batches(rank_samples: list[dict], config: BenchConfig) -> dict:
    """What the plans trained on: the stream (or the example batch), whether every plan on
    every rank had the same global batch at each measured step (a fair comparison), and how
    many different batches the measured steps saw."""
    seen = [samples[spec.label].get("batches", []) for samples in rank_samples for spec in config.plans]
    return {
        "source": config.stream.describe() if config.stream is not None else "the model's example batch every step",
        "same_for_every_plan": all(s == seen[0] for s in seen),
        "distinct_measured": len({d for digests in seen[0] for d in digests}),
    }


def _cluster_times(per_rank_spans: list[list[tuple[float, float]]], kind: str) -> list[float]:
    """Per step: last start to last end for phases that communicate, else the slowest rank."""
    times = []
    for spans in zip(*per_rank_spans):
        if kind == "compute":
            times.append(max(end - start for start, end in spans))
        else:
            times.append(max(end for _, end in spans) - max(start for start, _ in spans))
    return times


def _wire_per_node(per_rank: list[dict], ranks_per_node: int) -> list[dict] | None:
    """The link counters' samples of every node (its first rank read them), or None when
    no rank read any (no link to count)."""
    readers = [(rank // ranks_per_node, r) for rank, r in enumerate(per_rank) if r.get("wire_device")]
    if not readers:
        return None
    return [{"node": node, "device": r["wire_device"], "samples": [tuple(sample) for sample in r["wire"]]}
            for node, r in readers]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


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


def _peer_bytes(per_rank_steps: list[list[dict]]) -> dict[str, float]:
    """Mean over steps of the payload bytes all ranks handed a peer's collectives, per kind."""
    steps = max((len(steps) for steps in per_rank_steps), default=0)
    totals: dict[str, int] = {}
    for rank_steps in per_rank_steps:
        for step in rank_steps:
            for kind, nbytes in step.items():
                totals[kind] = totals.get(kind, 0) + nbytes
    return {kind: _exact_mean(total, steps) for kind, total in sorted(totals.items())} if steps else {}


def _exact_mean(total: int, count: int) -> float | int:
    return total // count if total % count == 0 else total / count


def machine_info() -> dict:
    return {
        "cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__, "backend": "gloo (CPU)",
    }
