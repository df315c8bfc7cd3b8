"""The plan: a topology plus an ordered pass list, and the vocabulary passes and runtime share.

This module knows no pass. Passes and the runtime both import it, so the words they must
agree on live here: the topology and its process groups, and the priority classes that a
pass tags collectives with and the runtime's scheduler enforces. The pass manager
(`commfx.passes.check_plan`) checks a plan against the registered passes before anything is
traced, so a user never waits for a capture (or a multi-process launch) to learn that 6
experts cannot be split over 4 ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class PlanError(ValueError):
    """A plan that does not fit the passes, the model or the topology."""


def said_once_per_node(error: PlanError, environ: Mapping[str, str] = os.environ) -> PlanError:
    """`error`, for an error every rank hits alike (a plan checked before any rank-dependent
    step): under torchrun only local rank 0 carries the message, so a node's log says it
    once; the other local ranks point to it."""
    local_rank = int(environ.get("LOCAL_RANK", "0") or 0)
    if local_rank == 0:
        return error
    return PlanError(f"the plan is refused on every rank; local rank 0 of this node prints why (this is local rank {local_rank})")


@dataclass(frozen=True)
class Topology:
    """How ranks are laid out. `ep` defaults to the whole world; nodes hold `ranks_per_node`.

    The link and compute figures feed cost models (partition_a2a's k=auto): the
    inter-node link is per node (its ranks share it); defaults are a 100 Gb/s network and
    a GPU doing 100 TFLOP/s. `commfx bench` sets them from its emulated link and calibration.
    """

    world_size: int
    ranks_per_node: int = 0  # 0: every rank on one node
    ep: int = 0  # 0: expert parallelism over the whole world
    pp: int = 1
    tp: int = 1
    inter_node_bandwidth: float = 12.5e9  # bytes/s of one node's link
    inter_node_latency_s: float = 5e-6
    intra_node_bandwidth: float = 100e9  # bytes/s between ranks of one node
    intra_node_latency_s: float = 3e-6
    flops_per_s: float = 100e12  # per rank
    # fixed cost of one collective beyond the wire's latency: launch, software stack, waiting
    # for the slowest peer (tens of microseconds with NCCL; milliseconds for gloo on shared CPUs)
    collective_overhead_s: float = 20e-6
    # what each message of a collective adds (posting and completing one send: a few microseconds);
    # the hierarchical all-to-all's cost model counts messages (cost.all_to_all)
    message_overhead_s: float = 2e-6
    # what one more chunk of a partitioned MoE region costs (a collective and smaller kernels):
    # 0 = the device's typical figure (cost.moe.CHUNK_OVERHEAD_S); Plan(machine="measure") sets
    # it to the measured cost of one collective plus that figure
    chunk_overhead_s: float = 0.0

    @classmethod
    def from_env(cls, world_size: int | None = None, environ: Mapping[str, str] | None = None, **fields: Any) -> "Topology":
        """This launch's topology: what the caller leaves out comes from torchrun's environment.

        torchrun gives every rank WORLD_SIZE, and LOCAL_WORLD_SIZE ranks per node, so on several
        nodes the ranks per node are known without the user repeating them (`locality_gate`
        and `hierarchical_a2a` plan for the real machine). A given `ranks_per_node` (0 counts
        as not given) must agree; nodes must hold equal numbers of ranks. A plan for another
        world than torchrun's (a single-process reference inside a rank) takes nothing from it,
        and outside torchrun the fields are used as given.
        """
        env = os.environ if environ is None else environ
        torchrun_world = _env_int(env, "WORLD_SIZE")
        if world_size is None:
            if torchrun_world is None:
                raise PlanError("the plan has no world size: pass world_size=..., or run under torchrun, which sets WORLD_SIZE")
            world_size = torchrun_world
        local = _env_int(env, "LOCAL_WORLD_SIZE")
        if local is None or world_size != torchrun_world:
            return cls(world_size=world_size, **fields)
        nodes = _env_int(env, "GROUP_WORLD_SIZE")
        if local < 1 or world_size % local or (nodes is not None and nodes * local != world_size):
            raise PlanError(
                f"torchrun started {world_size} ranks (WORLD_SIZE)"
                + (f" on {nodes} nodes (GROUP_WORLD_SIZE)" if nodes is not None else "")
                + f", but this node has {local} (LOCAL_WORLD_SIZE); commfx needs the same number of ranks on every node: "
                "give every node's torchrun the same --nproc-per-node"
            )
        given = fields.get("ranks_per_node") or 0
        if given and given != local:
            raise PlanError(
                f"ranks_per_node={given} disagrees with torchrun's LOCAL_WORLD_SIZE={local} (its --nproc-per-node); "
                f"drop ranks_per_node to take torchrun's, or start {given} ranks per node"
            )
        rank, node = _env_int(env, "RANK"), _env_int(env, "GROUP_RANK")
        if rank is not None and node is not None and rank // local != node:
            raise PlanError(
                f"rank {rank} is on torchrun's node {node} (GROUP_RANK), not node {rank // local} = rank // LOCAL_WORLD_SIZE {local}; "
                "commfx needs the ranks numbered node by node"
            )
        return cls(world_size=world_size, **{**fields, "ranks_per_node": local})

    @property
    def expert_parallel_size(self) -> int:
        """Expert parallelism lives inside one pipeline stage's dp x tp ranks (default: all of them)."""
        return self.ep or self.dp * self.tp

    @property
    def dp(self) -> int:
        """Replicas of the non-expert parameters."""
        return self.world_size // (self.pp * self.tp)

    @property
    def node_size(self) -> int:
        return self.ranks_per_node or self.world_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def validate(self) -> None:
        if self.world_size < 1:
            raise PlanError(f"world size must be at least 1, got {self.world_size}")
        if self.tp < 1 or self.world_size % self.tp:
            raise PlanError(
                f"tensor-parallel size {self.tp} must divide the world size {self.world_size}; "
                f"choose tp from {divisors(self.world_size)} (--tp)"
            )
        if self.pp < 1 or (self.world_size // self.tp) % self.pp:
            raise PlanError(
                f"pipeline-parallel size {self.pp} must divide the world size {self.world_size}"
                + (f" divided by tp {self.tp}" if self.tp > 1 else "")
                + f"; choose pp from {divisors(self.world_size // self.tp)} (--pp)"
            )
        ep = self.expert_parallel_size
        stage = self.dp * self.tp
        if ep < 1 or stage % ep:
            where = f"the ranks of a pipeline stage, {stage} (world {self.world_size} / pp {self.pp})" if self.pp > 1 else f"the world size {self.world_size}"
            raise PlanError(f"expert-parallel size {ep} must divide {where}; choose ep from {divisors(stage)}")
        if self.ranks_per_node and self.world_size % self.ranks_per_node:
            raise PlanError(
                f"ranks per node {self.ranks_per_node} must divide the world size {self.world_size}"
            )

    def rank_of(self, pp_idx: int, dp_idx: int, tp_idx: int = 0) -> int:
        """Rank order: tp fastest, then dp, then pp."""
        return pp_idx * (self.dp * self.tp) + dp_idx * self.tp + tp_idx

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_idx, dp_idx, tp_idx) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def tp_index(self, rank: int) -> int:
        """This rank's position in its tensor-parallel group (tp is the fastest-varying index)."""
        return self.coordinates(rank)[2]

    def dp_index(self, rank: int) -> int:
        """Which data shard this rank reads: the ranks of one tensor-parallel group read the same rows."""
        return self.coordinates(rank)[1]

    def process_groups(self) -> dict[str, list[list[int]]]:
        """Every group the plan uses, as lists of global ranks, in a fixed creation order.

        `ep` carries the expert all-to-alls (blocks of consecutive ranks inside one pipeline
        stage's dp x tp ranks), `edp` the gradients of expert shards that are replicated when
        ep < dp x tp (ranks at the same position in every ep block of a stage), `tp` the
        tensor-parallel all-reduces (blocks of tp consecutive ranks), `pp` the point-to-point
        traffic of one pipeline (same dp and tp index, ordered by stage), `dp` the replicated
        gradients (same pp and tp index; the world when pp = tp = 1). With pp > 1, `pp_ends`
        (first and last stage of one pipeline) and `pp_ends_dp` (first and last stage of every
        pipeline) synchronise a weight both ends hold (a tied embedding).
        """
        ep, pp, dp, tp = self.expert_parallel_size, self.pp, self.dp, self.tp
        world = list(range(self.world_size))
        dp_groups = [[self.rank_of(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
        stages = [world[s : s + dp * tp] for s in range(0, self.world_size, dp * tp)]  # the ranks of one stage
        ep_groups = [stage[i : i + ep] for stage in stages for i in range(0, dp * tp, ep)]
        edp_groups = [stage[i::ep] for stage in stages for i in range(ep)]
        tp_groups = [world[i : i + tp] for i in range(0, self.world_size, tp)]
        pp_groups = [[self.rank_of(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
        groups = {"world": [world], "ep": ep_groups, "edp": edp_groups, "tp": tp_groups, "pp": pp_groups, "dp": dp_groups}
        if pp > 1:
            groups["pp_ends"] = [[g[0], g[-1]] for g in pp_groups]
            groups["pp_ends_dp"] = [sorted(r for g in pp_groups if g[0] % tp == t for r in (g[0], g[-1])) for t in range(tp)]
        return groups


# The plan's precision settings (their dtypes live with the transform: compiler.precision).
PRECISIONS = ("fp32", "bf16")
MACHINE_FIGURES = ("given", "measure")  # Plan.machine: the topology's figures as written, or timed on the ranks
# Plan.compute: "inductor" compiles the compute between collectives and runtime hooks
# (compiler/compile_regions.py); "interpret" runs every node through the graph executor
# (debugging, bit-for-bit comparisons). COMMFX_COMPUTE sets the default (the tests' is interpret).
COMPUTE_MODES = ("inductor", "interpret")


def default_compute(env: Mapping[str, str] = os.environ) -> str:
    """The compute mode a plan gets when none is given: COMMFX_COMPUTE, else inductor."""
    return env.get("COMMFX_COMPUTE", "").strip() or "inductor"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """An integer environment variable (None when unset or empty)."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"{name}={text!r} in the environment is not an integer") from None


@dataclass(frozen=True)
class PassSpec:
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "PassSpec":
        """`name` or `name:key=value;key=value` as written on the command line."""
        name, _, rest = text.strip().partition(":")
        options: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in rest.split(";"))):
            key, eq, value = item.partition("=")
            if not eq:
                raise PlanError(f"pass option {item!r} in {text!r} must be written key=value")
            if re.search(r":\s*\w+\s*=", value):  # k=2:priority=true
                fixed = f"{name.strip()}:{rest.replace(':', ';')}"
                raise PlanError(f"options of one pass are separated by ';', not ':': write {fixed!r} instead of {text.strip()!r}")
            options[key.strip()] = value.strip()
        return cls(name.strip(), options)


@dataclass(frozen=True)
class Plan:
    """What to run and where. `grad_reduction` says how replicated gradients combine:
    `mean` (like DDP: each rank's loss is a mean over its own batch) or `sum`."""

    topology: Topology
    passes: tuple[PassSpec, ...] = ()
    grad_reduction: str = "mean"
    collective_timeout_s: float = 120.0
    # Gradients are all-reduced in buckets of about this size, each as soon as backward has
    # produced it (DDP's scheme; DDP's first bucket is 1 MiB).
    grad_bucket_bytes: int = 1 << 20
    # Mixed precision: "fp32" computes in the model's dtype; "bf16" keeps float32 parameters
    # (the masters the optimizer steps) and computes as torch.autocast would (matmuls, attention
    # and experts in bfloat16; norms, softmax, the router and the loss in float32), so
    # all-to-alls move bfloat16 rows; gradients of the float32 masters are reduced in float32.
    precision: str = "fp32"
    # The dtype replicated gradients cross the wire in: fp32 (default), or bf16 (half the
    # all-reduce bytes; each rank's gradient and the sum rounded to bf16, the result returned in
    # the parameters' dtype). Not under shard_states or pipeline_split, whose syncs are their own.
    grad_reduce_dtype: str = "fp32"
    # Where the cost models' figures (compute rate, per-collective overhead, link bandwidth) come
    # from: "given", the topology's as written (the same choices on any machine: what `commfx
    # dump` shows); "measure", timed on the ranks before compiling (runtime/machine_probe.py),
    # what `commfx run` and `commfx bench` do unless figures are given.
    machine: str = "given"
    # How the compute between collectives runs: see COMPUTE_MODES (--compute).
    compute: str = field(default_factory=default_compute)
    # Activation recomputation (--activation-memory-budget): None saves every activation the
    # backward reads; b in (0, 1] keeps about b of them (aot_autograd's min-cut partition under
    # that budget, compiler/remat.py) and the backward recomputes the rest.
    activation_memory_budget: float | None = None

    @classmethod
    def from_cli(cls, passes: str, world_size: int | None = None, **topology: Any) -> "Plan":
        """A plan from a pass list as written on the command line; the topology's defaults
        come from torchrun's environment where there is one (`Topology.from_env`)."""
        specs = tuple(PassSpec.parse(p) for p in _split_passes(passes))
        return cls(Topology.from_env(world_size, **topology), specs)

    @property
    def grad_scale(self) -> float:
        """What summed replicated gradients are multiplied by (1/dp under mean, like DDP: the
        ranks of one tensor-parallel group read the same rows, so they count once; dp is the
        world when there is neither a pipeline nor tensor parallelism)."""
        return 1.0 / self.topology.dp if self.grad_reduction == "mean" else 1.0

    def grad_scale_for(self, group: str) -> float:
        """The factor for gradients summed over `group`. Expert gradients (`edp`) arrive
        through the all-to-all summed over the tokens of every rank of a stage, and the ranks
        of a tensor-parallel group send the same tokens, so under mean they take 1/(dp x tp)."""
        if group == "edp" and self.grad_reduction == "mean":
            return 1.0 / (self.topology.dp * self.topology.tp)
        return self.grad_scale

    def pass_names(self) -> list[str]:
        return [p.name for p in self.passes]

    def validate(self) -> "Plan":
        """Check the topology and the plan's own fields (the pass manager's `check_plan`
        checks the passes against the registry and the model)."""
        self.topology.validate()
        if self.grad_reduction not in ("mean", "sum"):
            raise PlanError(f"grad_reduction must be 'mean' or 'sum', got {self.grad_reduction!r}")
        if self.precision not in PRECISIONS:
            raise PlanError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r} "
                "(bf16: float32 master weights, bfloat16 compute; --precision)"
            )
        if self.grad_reduce_dtype not in PRECISIONS:
            raise PlanError(f"grad_reduce_dtype must be one of {', '.join(PRECISIONS)}, got {self.grad_reduce_dtype!r} (--grad-reduce)")
        if self.machine not in MACHINE_FIGURES:
            raise PlanError(f"machine must be one of {', '.join(MACHINE_FIGURES)}, got {self.machine!r} (--machine)")
        if self.compute not in COMPUTE_MODES:
            raise PlanError(
                f"compute must be one of {', '.join(COMPUTE_MODES)}, got {self.compute!r} "
                "(--compute, or COMMFX_COMPUTE in the environment)"
            )
        budget = self.activation_memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1):
            raise PlanError(
                f"activation_memory_budget must be a number in (0, 1] or None, got {budget!r}: the share of activations the forward "
                "keeps for the backward (1 keeps what the min-cut partition keeps, smaller recomputes more; --activation-memory-budget)"
            )
        own_sync = [name for name in ("shard_states", "pipeline_split") if name in self.pass_names()]
        if self.grad_reduce_dtype != "fp32" and own_sync:
            raise PlanError(
                f"--grad-reduce {self.grad_reduce_dtype} does not apply to {own_sync[0]}, which reduces gradients its own way; "
                "drop --grad-reduce (fp32) or the pass"
            )
        return self

    def spec_for(self, name: str) -> "PassSpec":
        """The plan's spec of pass `name` (no options if the plan does not list it)."""
        return next((p for p in self.passes if p.name == name), PassSpec(name))


def _split_passes(text: str) -> list[str]:
    """Split `a,b:x=1;y=2,c` on the commas that separate passes."""
    return [p for p in (part.strip() for part in text.split(",")) if p]


# --------------------------------------------------------------------- priority classes
# Lina's rule: all-to-all blocks compute (experts wait for their tokens), gradient
# all-reduce does not. Passes tag every collective with a class; the runtime's scheduler
# (`commfx.runtime.priority`) gives each class a lane. The names live here so a pass can
# tag and the verifier can check without either importing the runtime.


@dataclass(frozen=True)
class PriorityClass:
    name: str
    level: int  # lower issues first
    description: str
    groups: tuple[str, ...] = ()  # the process groups this class uses (its clones); () = every group
    overlaps_compute: bool = False  # its traffic hides behind compute (gradients); the others block it: urgent on a GPU


PRIORITY_CLASSES: dict[str, PriorityClass] = {}
# Control traffic (count exchanges, barriers) rides with the all-to-alls: it is on the
# critical path too, and sharing their lane keeps one FIFO per process group.
DEFAULT_CLASS = "a2a"


def register_priority_class(name: str, level: int, description: str, groups: tuple[str, ...] = (), overlaps_compute: bool = False) -> PriorityClass:
    """Add a class (passes that bring their own traffic call this at import). `groups`
    limits the process groups cloned for it (default: all of the plan's groups);
    `overlaps_compute` marks traffic no computation waits on at once (on CUDA its process
    groups keep normal-priority streams; the others get high-priority ones)."""
    existing = PRIORITY_CLASSES.get(name)
    if existing is not None and existing.level != level:
        raise ValueError(f"priority class {name!r} already registered with level {existing.level}")
    PRIORITY_CLASSES[name] = PriorityClass(name, level, description, tuple(groups), overlaps_compute)
    return PRIORITY_CLASSES[name]


def priority_class(name: str) -> PriorityClass:
    try:
        return PRIORITY_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown priority class {name!r} (known: {', '.join(sorted(PRIORITY_CLASSES))})") from None


register_priority_class("a2a", 0, "expert all-to-all and control traffic: blocks compute")
register_priority_class("grad", 100, "gradient all-reduce: overlaps backward, pre-emptible between chunks", overlaps_compute=True)
# defer_grad_sync: buckets of parameters the next forward uses first, ahead of the rest of the gradients
register_priority_class("grad_next", 90, "gradient all-reduce the next forward waits for first (defer_grad_sync)", groups=("dp", "edp"), overlaps_compute=True)
# Pipeline stages wait for each other's activations and gradients: critical, like all-to-all,
# on clones of the pp groups only (a lane per direction and peer keeps sends from blocking recvs).
register_priority_class("pp", 10, "pipeline point-to-point: activations forward, activation gradients backward", groups=("pp",))
