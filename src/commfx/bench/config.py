"""What `commfx bench` measures: the plans (validated against the model before any rank
starts), the model and its benchmark-sized preset, the cluster's shape and the rounds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..plan import Plan
from ..verify import preflight
from .links import LinkSpec
from .straggler import SlowRank
from .stream import BATCH_MODES, BatchStream, model_vocabulary, wants_stream

PEER_PREFIX = "peer:"

# Benchmark-sized configurations of built-in models: big enough that compute and
# communication both take milliseconds on the emulated cluster (see benchmarks/log/notebook-2026-11.md).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt-moe": {
        "num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_experts": 8, "top_k": 2,
        "expert_hidden": 256, "vocab_size": 512, "max_seq": 64, "batch": 32, "seq": 64,
    },
}


@dataclass(frozen=True)
class PlanSpec:
    """One plan to measure: a label for tables, the --passes text, and the validated plan."""

    label: str
    passes: str
    plan: Plan  # for a peer: the world and expert-parallel size it runs with
    peer: str | None = None  # `peer:NAME[:options]`: the system a user would pick instead (bench/peers/)

    @property
    def peer_parts(self) -> tuple[str, dict[str, str]]:
        """(NAME, options) of a peer."""
        from .peers import parse_peer

        return parse_peer(self.peer)


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
    # Per node, the device whose counters are its inter-node link (set by run_bench once the
    # cluster exists; () without a link to count: one node, or plain localhost).
    link_devices: tuple[str, ...] = ()
    # Every plan's batches: None, the model's example batch every step; else a new batch a
    # step (--batches; by default for runs with split_embedding_comm, whose 2d schedule needs it).
    stream: BatchStream | None = None


def build_config(model: str, passes: str, vs: str | None, *, nodes: int, ranks_per_node: int, ep: int = 0, pp: int = 1,
                 model_kwargs: dict[str, Any] | None = None, steps: int = 10, warmup: int = 2, steps_per_round: int = 1,
                 lr: float = 1e-3, seed: int = 0, also: list[tuple[str, str]] | None = None,
                 link: LinkSpec | None = None, flops_per_rank: float | None = None,
                 grad_bucket_bytes: int | None = None, collective_overhead_s: float | None = None,
                 collective_timeout_s: float | None = None, tp: int = 1, slow_rank: tuple[int, float] | None = None,
                 slow_method: str = "auto", healthy: tuple[str, ...] = (),
                 plan_fields: dict[str, Any] | None = None, batches: str = "auto") -> BenchConfig:
    """Validate every plan against the model before any rank starts.

    Plans: the one under test ("plan"), the baseline (`vs`, "baseline") and any `also`
    (label, passes) pairs, all interleaved. The link and compute figures go into each
    plan's topology, where cost models (partition_a2a k=auto) read them. `slow_rank`
    (rank, factor) makes that rank a straggler in every plan but the `healthy` ones.
    `plan_fields` (e.g. precision) are set on every commfx plan; peers run as they are.
    `batches` (auto, stream, fixed): whether every plan gets a stream of batches
    (:mod:`.stream`); auto streams when a plan has split_embedding_comm.
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
        peer = text.removeprefix(PEER_PREFIX) if text.startswith(PEER_PREFIX) else None
        # A peer's plan carries only its world and ep size: the peer lays out pp and tp itself.
        passes, sizes = ("lift", {"pp": 1, "tp": 1}) if peer else (text, {"pp": pp, "tp": tp})
        plan = Plan.from_cli(passes, world_size=world, ep=ep, ranks_per_node=ranks_per_node, **sizes, **figures)
        if grad_bucket_bytes:
            plan = dataclasses.replace(plan, grad_bucket_bytes=grad_bucket_bytes)
        if collective_timeout_s:
            plan = dataclasses.replace(plan, collective_timeout_s=collective_timeout_s)
        if plan_fields and not peer:
            plan = dataclasses.replace(plan, **plan_fields)
        return PlanSpec(label, text, plan, peer)

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
        slowed_peers = [s.label for s in specs if s.peer and s.label not in healthy]
        if slowed_peers and slow_method != "cgroup":
            raise ValueError(f"--slow-rank slows a peer ({', '.join(slowed_peers)}) only with --slow-method cgroup "
                             "(the delay method works through commfx's scheduler, which a peer does not use), or list it in --healthy")
    for s in specs:  # every plan compiles here first: errors surface once, before ranks start
        model_module, inputs = load_model(model, seed=seed, **kwargs)
        if s.peer:
            _peer_preflight(s, model_module, inputs)
        else:
            preflight(model_module, s.plan, inputs)
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    stream = _stream(batches, specs, model_module, inputs, seed)
    return BenchConfig(model, kwargs, tuple(specs), nodes, ranks_per_node, steps=steps, warmup=warmup, lr=lr, seed=seed,
                       slow_rank=slow_rank, slow_method=slow_method, healthy=tuple(healthy), steps_per_round=steps_per_round,
                       stream=stream)


def _stream(batches: str, specs: list[PlanSpec], model, inputs, seed: int) -> BatchStream | None:
    """The run's stream of batches, or None (the example batch every step); every peer of a
    streamed run must take a new batch each step."""
    if batches not in BATCH_MODES:
        raise ValueError(f"--batches must be {', '.join(BATCH_MODES)}; got {batches!r}")
    if batches == "fixed" or batches == "auto" and not wants_stream([s.plan for s in specs if not s.peer]):
        return None
    from .peers import peer_module

    fixed = [s.passes for s in specs if s.peer and getattr(peer_module(s.peer_parts[0]), "FIXED_BATCH", False)]
    if fixed:
        raise ValueError(f"{', '.join(fixed)} runs one fixed batch, but this run streams batches (--batches {batches}: "
                         "a new batch every step, for split_embedding_comm); compare with another peer or use --batches fixed")
    stream = BatchStream(model_vocabulary(model), seed)
    stream.batch(inputs, 0)  # a batch the model cannot take fails here, once
    return stream


def _peer_preflight(spec: PlanSpec, model, inputs) -> None:
    """What the peer would refuse on every rank, said once here (unknown peer, a model it
    cannot express, its system not installed)."""
    from .peers import peer_module

    try:
        name, options = spec.peer_parts
        module = peer_module(name)
        module.preflight(model, ep_size=spec.plan.topology.expert_parallel_size, world_size=spec.plan.topology.world_size,
                         inputs=inputs, **options)
    except ImportError as missing:
        raise ValueError(f"{spec.passes}: {missing.name or missing} is not installed (pip install 'commfx[peers]')") from None
    except ValueError as refused:
        raise ValueError(f"{spec.passes} ({spec.label}): {refused}") from None
