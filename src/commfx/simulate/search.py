"""`commfx plan`: choose a plan by simulating candidates on the cluster.

The candidates are the pass lists and options the simulator models: expert parallelism at
every ep size that divides the world and the experts, partitioned all-to-all
(`partition_a2a:k` in 1, 2, 4, 8, auto), expert packing (`pack_experts:degree`, the experts
per device of that ep), tensor parallelism inside a node (tp 2, 4, 8), pipelines (pp up to
the model's layers, pp or 4 pp micro-batches) and their boundary compression
(`compress_pipeline:rank` 4, 16, 64), the locality gate (top-1 routers, experts on more
than one node), sparse embedding communication (untied tables; `schedule=2d` beside the
default: row gradients exchanged into the next forward), ZeRO stages 1-3, bf16
where the device has a bf16 rate, and activation recomputation (`--activation-memory-budget`
0.5, 0.25, 0.1), tried on the fastest plans over the memory limit (on every `--candidate`
plan when none fits). The search is a beam over those dimensions in that order: the MoE
communication structure is enumerated in full, then each dimension extends the best few
plans so far (a dimension's choices barely interact with the ones already made, and the
full product is hundreds of plans). Plans are ranked by predicted step among those that
fit the memory limit (the simulator's held bytes per rank, activations included); a plan a
pass refuses is listed with the pass's reason. The model is traced once (`Captures`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..compiler.program import PassError
from ..plan import Plan, PlanError
from . import Captures, Prediction, simulate, topology_for
from .cluster import Cluster

K_CHOICES = ("1", "2", "4", "8", "auto")
MICROBATCHES_PER_STAGE = (1, 4)  # pipeline_split:microbatches = pp x each
COMPRESSION_RANKS = (4, 16, 64)
BEAM = 3
ACTIVATION_BUDGETS = (0.5, 0.25, 0.1)  # tried on plans over the memory limit: recompute to fit
LOSSY = {"locality_gate": "changes routing (lossy)", "compress_pipeline": "low-rank boundary gradients (lossy)"}
# Passes that come after the model-parallel ones in a pass list (a dimension inserts before them).
LATER = ("pipeline_split", "compress_pipeline", "shard_states")


@dataclass(frozen=True)
class Candidate:
    passes: str
    ep: int = 0  # 0: the data-parallel size
    precision: str = "fp32"
    pp: int = 1
    tp: int = 1
    activation_memory_budget: float | None = None

    def command_args(self) -> str:
        """The flags that run this plan: `--passes ...` and, where not the default, --ep, --pp, --tp, --precision and
        --activation-memory-budget."""
        defaults = {"ep": 0, "pp": 1, "tp": 1}
        sizes = "".join(f" --{name} {getattr(self, name)}" for name, default in defaults.items() if getattr(self, name) != default)
        budget = f" --activation-memory-budget {self.activation_memory_budget:g}" if self.activation_memory_budget is not None else ""
        return f"--passes {self.passes}{sizes}" + (f" --precision {self.precision}" if self.precision != "fp32" else "") + budget

    def with_passes(self, passes: str) -> Candidate:
        return dataclasses.replace(self, passes=passes)


@dataclass
class Ranked:
    candidate: Candidate
    prediction: Prediction | None = None
    refused: str = ""  # why a pass refused the plan
    fits: bool = True
    why: str = ""

    @property
    def step_s(self) -> float:
        return self.prediction.result.step_s if self.prediction else float("inf")

    @property
    def memory_bytes(self) -> float:
        return self.prediction.result.memory["total"] if self.prediction else float("inf")

    def key(self) -> tuple:
        """Usable first, then fitting, then by step; of equal steps the shorter pass list."""
        return (self.refused != "", not self.fits, round(self.step_s, 9), len(self.candidate.command_args()))

    def same_as(self, other: Ranked) -> bool:
        """Predicted alike in step and memory: the longer plan's extra passes change nothing here."""
        return bool(self.prediction and other.prediction) and abs(self.step_s - other.step_s) <= 1e-9 * other.step_s and self.memory_bytes == other.memory_bytes


@dataclass
class Facts:
    """What the candidates depend on, read off the lifted graph."""

    num_experts: int = 0  # 0: no MoE block
    top_k: int = 0
    untied_tables: int = 0
    layers: int = 1  # the most pipeline stages the model can be cut into
    batch_rows: int = 0  # the global batch's rows (micro-batches must cut a data-parallel rank's share)


@dataclass
class SearchResult:
    ranked: list[Ranked]  # every plan simulated, best first (fitting, then over the limit, then refused)
    baseline: Ranked | None
    memory_limit: float
    facts: Facts
    simulated: int = 0
    duplicates: int = 0  # plans predicted exactly as a shorter one (extra passes without effect here), not listed

    @property
    def fitting(self) -> list[Ranked]:
        return [r for r in self.ranked if not r.refused and r.fits]

    @property
    def over_limit(self) -> list[Ranked]:
        return [r for r in self.ranked if not r.refused and not r.fits]

    @property
    def refused(self) -> list[Ranked]:
        return [r for r in self.ranked if r.refused]


@dataclass
class Planner:
    """Simulates candidates of one model on one cluster, each once."""

    model: str
    cluster: Cluster
    memory_limit: float
    model_kwargs: dict = field(default_factory=dict)
    seed: int = 0
    rows_per_rank: int | None = None  # trace one sequence per rank, simulate this many (see `simulate`)
    captures: Captures = field(default_factory=Captures)
    seen: dict[Candidate, Ranked] = field(default_factory=dict)

    def __post_init__(self):
        if self.rows_per_rank:
            self.model_kwargs["batch"] = self.cluster.world_size

    def run(self, candidate: Candidate) -> Ranked:
        if candidate in self.seen:
            return self.seen[candidate]
        ranked = Ranked(candidate)
        try:
            plan = Plan.from_cli(candidate.passes, world_size=self.cluster.world_size, ep=candidate.ep, ranks_per_node=self.cluster.ranks_per_node,
                                 pp=candidate.pp, tp=candidate.tp)
            plan = dataclasses.replace(plan, precision=candidate.precision, activation_memory_budget=candidate.activation_memory_budget)
            ranked.prediction = simulate(self.model, plan, self.cluster, seed=self.seed, model_kwargs=self.model_kwargs, captures=self.captures,
                                         rows_per_rank=self.rows_per_rank)
            ranked.fits = ranked.memory_bytes <= self.memory_limit
        except (PlanError, PassError, ValueError) as error:  # a pass refuses the plan for this model or layout
            ranked.refused = str(error)
        except RuntimeError as error:  # a defect in one plan's compile: listed, the search goes on
            ranked.refused = f"failed to compile ({type(error).__name__}: {error})"
        self.seen[candidate] = ranked
        return ranked

    def facts(self) -> Facts:
        """Experts, top-k and untied embedding tables of the model, from its lifted graph."""
        from ..compiler.pipeline import compile_program
        from ..passes.pipeline_split import count_model_layers

        plan = topology_for(self.cluster, Plan.from_cli("lift", world_size=self.cluster.world_size, ranks_per_node=self.cluster.ranks_per_node))
        model, local, captured = self.captures.get(self.model, self.seed, self.model_kwargs, plan.topology.dp)
        regions = compile_program(model, plan, local, captured=captured).regions
        blocks = regions.moe_blocks
        return Facts(
            num_experts=blocks[0].num_experts if blocks else 0, top_k=max((b.top_k for b in blocks), default=0),
            untied_tables=sum(1 for t in regions.embeddings if t.trainable and not t.tied),
            layers=max(1, count_model_layers(model)),
            batch_rows=self.rows_per_rank * self.cluster.world_size if self.rows_per_rank else _rows(self.captures.inputs),
        )


def structures(facts: Facts, world: int) -> list[Candidate]:
    """The MoE communication structures: no expert parallelism, then per ep size plain,
    partitioned (each k), packed, and packed + partitioned."""
    out = [Candidate("lift")]
    if not facts.num_experts:
        return out
    for ep in (e for e in range(2, world + 1) if world % e == 0 and facts.num_experts % e == 0):
        flag = 0 if ep == world else ep
        degree = facts.num_experts // ep
        ep_passes = "lift,expert_parallel"
        out.append(Candidate(ep_passes, flag))
        out += [Candidate(f"{ep_passes},partition_a2a:k={k}", flag) for k in K_CHOICES]
        out.append(Candidate(f"{ep_passes},pack_experts:degree={degree}", flag))
        out += [Candidate(f"{ep_passes},pack_experts:degree={degree},partition_a2a:k={k}", flag) for k in K_CHOICES]
    return out


def extensions(candidate: Candidate, dimension: str, facts: Facts, cluster: Cluster) -> list[Candidate]:
    """`candidate` with each choice of one dimension (its own choice, unchanged, first):
    tp sizes inside a node, pipeline depths (up to the layers) with pp or 4 pp micro-batches
    (those that cut a data-parallel rank's rows), a pipeline's boundary compression rank,
    then the rest."""
    passes = candidate.passes
    out = [candidate]
    world = cluster.world_size
    if dimension == "tensor" and candidate.pp == 1:
        for tp in (t for t in (2, 4, 8) if cluster.ranks_per_node % t == 0 and world % t == 0 and t < world):
            out.append(dataclasses.replace(candidate, passes=_insert(passes, "tensor_parallel"), tp=tp))
    elif dimension == "pipeline" and candidate.pp == 1:
        for pp in (p for p in range(2, min(facts.layers, world) + 1) if (world // candidate.tp) % p == 0):
            rows = facts.batch_rows // (world // (pp * candidate.tp))  # a data-parallel rank's
            out += [dataclasses.replace(candidate, passes=_insert(passes, f"pipeline_split:microbatches={pp * m}"), pp=pp)
                    for m in MICROBATCHES_PER_STAGE if rows and rows % (pp * m) == 0]
    elif dimension == "compression" and candidate.pp > 1:
        out += [candidate.with_passes(_insert(passes, f"compress_pipeline:rank={r}", before=("shard_states",))) for r in COMPRESSION_RANKS]
    elif dimension == "locality" and facts.top_k == 1 and "expert_parallel" in passes and cluster.nodes > 1:
        out.append(candidate.with_passes(passes.replace("lift,", "lift,locality_gate,", 1)))
    elif dimension == "embedding" and facts.untied_tables:
        out += [candidate.with_passes(f"{passes},split_embedding_comm{options}") for options in ("", ":schedule=2d")]
    elif dimension == "sharding":
        out += [candidate.with_passes(f"{passes},shard_states:stage={s}") for s in (1, 2, 3)]
    elif dimension == "precision" and "bf16" in cluster.device.flops:
        out.append(dataclasses.replace(candidate, precision="bf16"))
    elif dimension == "recompute" and candidate.activation_memory_budget is None:
        out += [dataclasses.replace(candidate, activation_memory_budget=b) for b in ACTIVATION_BUDGETS]
    return out


DIMENSIONS = ("tensor", "pipeline", "compression", "locality", "embedding", "sharding", "precision", "recompute")


def _rows(inputs) -> int:
    """Rows of a model's example batch (the first dimension of its first tensor input)."""
    values = inputs.values() if isinstance(inputs, dict) else (inputs[0] if len(inputs) == 2 and isinstance(inputs[1], dict) else inputs)
    return next((int(t.shape[0]) for t in values if hasattr(t, "shape") and len(t.shape)), 0)


def _plain(facts: Facts) -> list[Candidate]:
    """No communication rewrite, and naive expert parallelism where there are experts (the baseline)."""
    return [Candidate("lift")] + ([Candidate("lift,expert_parallel")] if facts.num_experts else [])


def _insert(passes: str, text: str, before: tuple[str, ...] = LATER) -> str:
    """`passes` with `text` added before the first of `before` it has, else at the end."""
    parts = passes.split(",")
    at = next((i for i, p in enumerate(parts) if p.split(":")[0] in before), len(parts))
    return ",".join(parts[:at] + [text] + parts[at:])


def search(
    model: str, cluster: Cluster, *, memory_limit: float, model_kwargs: dict | None = None, seed: int = 0,
    candidates: list[Candidate] | None = None, beam: int = BEAM, rows_per_rank: int | None = None,
) -> SearchResult:
    """Simulate candidates (the given ones, or the beam search's) and rank them."""
    planner = Planner(model, cluster, memory_limit, dict(model_kwargs or {}), seed, rows_per_rank)
    facts = planner.facts()
    if candidates is not None:
        given = [planner.run(candidate) for candidate in candidates]
        if given and not any(r.fits and not r.refused for r in given):  # none fits: each recomputes activations too
            for r in given:
                if not r.refused:
                    for candidate in extensions(r.candidate, "recompute", facts, cluster)[1:]:
                        planner.run(candidate)
        baseline = planner.run(candidates[0]) if candidates else None
    else:
        best = _best([planner.run(c) for c in structures(facts, cluster.world_size)], beam)
        plain = [planner.run(c) for c in _plain(facts)]
        for dimension in DIMENSIONS:
            # model parallelism re-lays out the experts a structure was sized for: grow the plain ones too
            seeds = best + [r for r in plain if r not in best] if dimension in ("tensor", "pipeline") else best
            if dimension == "embedding":  # split_embedding_comm refuses pipelines: grow the best plans without one too
                flat = _best([r for r in planner.seen.values() if r.candidate.pp == 1], beam)
                seeds = best + [r for r in flat if r not in best]
            if dimension == "recompute":  # recomputation only pays where memory is short: the fastest plans over the limit
                seeds = sorted((r for r in planner.seen.values() if not r.refused and not r.fits), key=Ranked.key)[:beam]
            grown = [planner.run(c) for r in seeds for c in extensions(r.candidate, dimension, facts, cluster)]
            best = _best(grown, beam)
        baseline = next((r for r in reversed(plain) if not r.refused), plain[-1])  # naive EP, else no rewrite
    ranked: list[Ranked] = []
    duplicates = 0
    for r in sorted(planner.seen.values(), key=Ranked.key):
        if candidates is None and any(r.same_as(kept) for kept in ranked):
            duplicates += 1
            continue
        r.why = explain(r, baseline)
        ranked.append(r)
    return SearchResult(ranked, baseline, memory_limit, facts, len(planner.seen), duplicates)


def _best(ranked: list[Ranked], beam: int) -> list[Ranked]:
    usable = sorted((r for r in ranked if not r.refused), key=Ranked.key)
    return usable[:beam] or ranked[:1]


def explain(ranked: Ranked, baseline: Ranked | None) -> str:
    """What the plan saves against the baseline: exposed communication, inter-node bytes, memory."""
    if ranked.refused:
        return ranked.refused
    if baseline is None or baseline.prediction is None or ranked is baseline:
        return "the baseline" if ranked is baseline else ""
    a, b = baseline.prediction.result, ranked.prediction.result
    parts = [f"exposed comm {a.exposed_comm_s * 1e3:.3g} -> {b.exposed_comm_s * 1e3:.3g} ms"]
    if abs(b.inter_node_bytes - a.inter_node_bytes) > 0.01 * max(a.inter_node_bytes, 1):
        parts.append(f"inter-node {a.inter_node_bytes / 1e6:.3g} -> {b.inter_node_bytes / 1e6:.3g} MB/node")
    if abs(b.compute_s - a.compute_s) > 0.02 * a.compute_s:
        parts.append(f"compute {a.compute_s * 1e3:.3g} -> {b.compute_s * 1e3:.3g} ms")
    if abs(b.memory["total"] - a.memory["total"]) > 0.01 * a.memory["total"]:
        parts.append(f"memory {a.memory['total'] / 1e6:.4g} -> {b.memory['total'] / 1e6:.4g} MB")
    parts += [why for name, why in LOSSY.items() if name in ranked.candidate.passes]
    if ranked.candidate.precision != baseline.candidate.precision:
        parts.append(f"{ranked.candidate.precision} compute (not bit-identical)")
    if ranked.candidate.activation_memory_budget is not None:
        parts.append(f"recomputes activations (budget {ranked.candidate.activation_memory_budget:g})")
    if not ranked.fits:
        parts.append("over the memory limit")
    return "; ".join(parts)
