"""`commfx simulate`: project a plan onto a cluster by simulating one training step.

`simulate(model_name, plan, cluster)` compiles the plan on one rank's share of the batch
(the same passes and cost-model choices a rank makes), reads the step off the program
(`workload`), and replays it on the cluster's device and links with the runtime's
scheduling rules (`engine`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..cost.figures import figures_of, with_figures
from ..plan import Plan, PlanError
from .cluster import Cluster, load_cluster, presets
from .engine import Result, Simulation
from .pipeline import simulate_pipeline
from .workload import build_workload

__all__ = ["Captures", "Cluster", "Prediction", "load_cluster", "presets", "simulate", "simulate_program", "topology_for"]

UNSUPPORTED = {
    "defer_grad_sync": "gradients settled in the next forward",
    "microbatch_overlap": "two micro-batches interleaved",
    "resize_tp": "a straggler controller",
}


@dataclass
class Prediction:
    model: str
    passes: str
    cluster: Cluster
    plan: Plan
    result: Result
    notes: list[str]
    choices: dict[str, str] = dataclasses.field(default_factory=dict)  # automatic choices compiled (passes.choices)

    def as_dict(self) -> dict:
        r = self.result
        return {
            "model": self.model, "passes": self.passes, "cluster": self.cluster.name, "nodes": self.cluster.nodes,
            "ranks_per_node": self.cluster.ranks_per_node, "world_size": self.cluster.world_size,
            "step_s": r.step_s, "compute_s": r.compute_s, "comm_s": r.comm_s, "exposed_comm_s": r.exposed_comm_s,
            "collectives_per_rank": r.collectives, "inter_node_bytes_per_node": r.inter_node_bytes,
            "intra_node_bytes_per_rank": r.intra_node_bytes, "link_utilisation": r.link_utilisation(self.cluster),
            "peak_memory_bytes_per_rank": r.memory, "activation_memory_budget": self.plan.activation_memory_budget,
            "pipeline_boundary_bytes_per_step": r.boundary_bytes or None, "notes": self.notes,
            "cost_model_figures": figures_of(self.plan.topology), "automatic_choices": self.choices,
        }


def topology_for(cluster: Cluster, plan: Plan, figures: dict[str, float] | None = None) -> Plan:
    """`plan` laid out on `cluster` (world, ranks per node), with the cluster's figures for
    the cost models (k=auto, packing degree, embedding strategy) to choose by, or `figures`
    (`cost.figures`: what a `commfx bench` run compiled with, `simulate.recorded`)."""
    device = cluster.device
    topology = dataclasses.replace(
        plan.topology, world_size=cluster.world_size, ranks_per_node=cluster.ranks_per_node,
        inter_node_bandwidth=cluster.inter_node.effective_bandwidth, inter_node_latency_s=cluster.inter_node.latency_s,
        intra_node_bandwidth=cluster.intra_node.effective_bandwidth, intra_node_latency_s=cluster.intra_node.latency_s,
        message_overhead_s=cluster.message_overhead_s,
        flops_per_s=device.flops.get("bf16" if plan.precision == "bf16" else "fp32", device.flops["fp32"]) * device.compute_efficiency,
        collective_overhead_s=cluster.collective_overhead_s,
    )
    if figures:
        topology = with_figures(topology, figures)
    topology.validate()
    return dataclasses.replace(plan, topology=topology)


class Captures:
    """One model, loaded once and traced once per rank share, for simulating many plans of
    it (`commfx plan`): capture is most of a simulation's time, and plans share it."""

    def __init__(self):
        self.key, self.model, self.inputs, self.traced = None, None, None, {}

    def get(self, model_name: str, seed: int, kwargs: dict, parts: int):
        """(model, rank 0's inputs, their captured program)."""
        from ..compiler.capture import capture
        from ..models import load_model
        from ..models.gpt_moe import grouped_experts

        key = (model_name, seed, tuple(sorted(kwargs.items())))
        if key != self.key:
            self.model, self.inputs = load_model(model_name, seed=seed, **kwargs)
            grouped_experts(self.model)  # capture's eager run at real widths fits in memory; the trace is the same
            self.key, self.traced = key, {}
        local = _rank_share(self.inputs, parts)
        if parts not in self.traced:
            self.traced[parts] = capture(self.model, local)
        return self.model, local, self.traced[parts]


def simulate(
    model_name: str, plan: Plan, cluster: Cluster, *, batch: int | None = None, seed: int = 0, model_kwargs: dict | None = None,
    captures: Captures | None = None, rows_per_rank: int | None = None, figures: dict[str, float] | None = None,
) -> Prediction:
    """Compile `plan` for one rank of `cluster` and simulate its training step (`captures`:
    reuse a trace of the same model across calls).

    `rows_per_rank`: trace one sequence per rank and simulate this many (every traced cost is
    linear in rows at a fixed sequence length): for models whose traced forward would not fit
    this machine's memory at the real batch (the per-row experts path copies an expert's
    weights for every routed row). `figures`: the cost models' figures to compile with
    instead of the cluster's (see `topology_for`)."""
    from ..compiler.pipeline import compile_program

    plan = topology_for(cluster, plan, figures)
    for name in plan.pass_names():
        if name in UNSUPPORTED:
            raise PlanError(f"commfx simulate does not model {name} yet ({UNSUPPORTED[name]}); simulate the plan without it")
    kwargs = dict(model_kwargs or {})
    if batch:
        kwargs["batch"] = batch
    if rows_per_rank:
        kwargs["batch"] = plan.topology.dp
    model, local, captured = (captures or Captures()).get(model_name, seed, kwargs, plan.topology.dp)
    scale = rows_per_rank or 1
    traced_tokens = captured.tokens_per_rank or 0
    traced_plan, microbatches = _one_traced_microbatch(plan) if rows_per_rank else (plan, 0)
    program = compile_program(model, traced_plan, local, captured=captured, tokens_per_rank=traced_tokens * scale if rows_per_rank else None)
    if microbatches:
        program.regions.pipeline = dataclasses.replace(program.regions.pipeline, microbatches=microbatches)
    return simulate_program(model_name, program, plan, cluster, scale=scale)


def _one_traced_microbatch(plan: Plan) -> tuple[Plan, int]:
    """With one traced row a rank, a pipeline cannot cut the trace into its micro-batches:
    compile it with one and cut the simulated rows instead. (plan to compile, micro-batches; 0
    without a pipeline)."""
    for i, spec in enumerate(plan.passes):
        if spec.name == "pipeline_split":
            count = int(spec.options.get("microbatches", 0)) or plan.topology.pp
            one = dataclasses.replace(spec, options={**spec.options, "microbatches": "1"})
            return dataclasses.replace(plan, passes=plan.passes[:i] + (one,) + plan.passes[i + 1 :]), count
    return plan, 0


def simulate_program(model_name: str, program, plan: Plan, cluster: Cluster, *, scale: float = 1.0) -> Prediction:
    """Simulate a compiled program: its all-to-alls split and moved by the runtime's own
    schedule pass (`overlap_collectives`: starts as early, waits as late as data allows);
    a split program stage by stage over its pipeline schedule (`pipeline`)."""
    from ..passes.choices import automatic_choices
    from ..passes.schedule.overlap import overlap_collectives

    tokens = program.tokens_per_rank or 0
    if program.regions.pipeline is not None:
        result, notes = simulate_pipeline(program, plan, cluster, tokens, scale)
        return Prediction(model_name, passes_text(plan), cluster, plan, result, list(program.notes) + notes, automatic_choices(program, plan))
    scheduled = program.derive()
    overlap_collectives(scheduled.gm)
    workload = build_workload(scheduled, plan, tokens, scale)
    result = Simulation(workload, program, plan, cluster).run()
    return Prediction(model_name, passes_text(plan), cluster, plan, result, list(program.notes) + workload.notes, automatic_choices(program, plan))


def passes_text(plan: Plan) -> str:
    """The plan's pass list as `--passes` takes it."""
    return ",".join(s.name + (":" + ";".join(f"{k}={v}" for k, v in s.options.items()) if s.options else "") for s in plan.passes)


def _rank_share(inputs, parts: int):
    """Rank 0's rows of the global batch (every rank's share is the same size or smaller)."""
    def share(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            rows = -(-t.shape[0] // parts)
            return t[:rows]
        return t

    if isinstance(inputs, dict):
        return {k: share(v) for k, v in inputs.items()}
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return tuple(share(t) for t in inputs[0]), {k: share(v) for k, v in inputs[1].items()}
    return tuple(share(t) for t in inputs)
