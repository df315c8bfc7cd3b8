"""The plan: a topology plus an ordered pass list, validated before anything is traced.

Bad plans fail here with a message that says what is wrong and how to fix it, so a user
never waits for a capture (or a multi-process launch) to learn that 6 experts cannot be
split over 4 ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


class PlanError(ValueError):
    """A plan that does not fit the passes, the model or the topology."""


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
    flops_per_s: float = 100e12  # per rank
    # fixed cost of one collective beyond the wire's latency: launch, software stack, waiting
    # for the slowest peer (tens of microseconds with NCCL; milliseconds for gloo on shared CPUs)
    collective_overhead_s: float = 20e-6

    @property
    def expert_parallel_size(self) -> int:
        return self.ep or self.world_size

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
        if self.pp != 1 or self.tp != 1:
            raise PlanError(
                f"pipeline (pp={self.pp}) and tensor (tp={self.tp}) parallel layouts are not supported yet; use pp=1 tp=1"
            )
        ep = self.expert_parallel_size
        if ep < 1 or self.world_size % ep:
            raise PlanError(
                f"expert-parallel size {ep} must divide the world size {self.world_size}; "
                f"choose ep from {divisors(self.world_size)}"
            )
        if self.ranks_per_node and self.world_size % self.ranks_per_node:
            raise PlanError(
                f"ranks per node {self.ranks_per_node} must divide the world size {self.world_size}"
            )

    def process_groups(self) -> dict[str, list[list[int]]]:
        """Every group the plan uses, as lists of global ranks, in a fixed creation order.

        `world` carries the replicated (data-parallel) gradients, `ep` the expert
        all-to-alls (blocks of consecutive ranks), `edp` the gradients of expert shards that
        are replicated when ep < world (ranks at the same position in every ep block).
        """
        ep = self.expert_parallel_size
        world = list(range(self.world_size))
        ep_groups = [world[i : i + ep] for i in range(0, self.world_size, ep)]
        edp_groups = [world[i :: ep] for i in range(ep)]
        return {"world": [world], "ep": ep_groups, "edp": edp_groups}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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

    @classmethod
    def from_cli(cls, passes: str, world_size: int, **topology: Any) -> "Plan":
        specs = tuple(PassSpec.parse(p) for p in _split_passes(passes))
        return cls(Topology(world_size=world_size, **topology), specs)

    @property
    def grad_scale(self) -> float:
        """What summed replicated gradients are multiplied by (1/world under mean, like DDP)."""
        return 1.0 / self.topology.world_size if self.grad_reduction == "mean" else 1.0

    def pass_names(self) -> list[str]:
        return [p.name for p in self.passes]

    def options_for(self, name: str):
        """The typed options dataclass of pass `name` (validated)."""
        from .passes import get_pass

        spec = next((p for p in self.passes if p.name == name), PassSpec(name))
        return build_options(get_pass(name), spec.options)

    def validate(self, model: torch.nn.Module | None = None) -> "Plan":
        """Check names, options, topology and (given the model) what the passes need of it."""
        from .passes import get_pass

        self.topology.validate()
        if self.grad_reduction not in ("mean", "sum"):
            raise PlanError(f"grad_reduction must be 'mean' or 'sum', got {self.grad_reduction!r}")
        seen: set[str] = set()
        for spec in self.passes:
            pass_cls = get_pass(spec.name)
            if spec.name in seen:
                raise PlanError(f"pass {spec.name!r} appears twice in the plan; list it once")
            seen.add(spec.name)
            missing = [r for r in pass_cls.requires_passes if r not in seen]
            if missing:
                raise PlanError(
                    f"pass {spec.name!r} needs {', '.join(missing)} before it; "
                    f"for example --passes {','.join(missing + [spec.name])}"
                )
            options = build_options(pass_cls, spec.options)
            pass_cls.check_plan(self, options, model)
        return self


def _split_passes(text: str) -> list[str]:
    """Split `a,b:x=1;y=2,c` on the commas that separate passes."""
    return [p for p in (part.strip() for part in text.split(",")) if p]


def build_options(pass_cls, raw: dict[str, Any]):
    """Turn a dict of (possibly string) values into the pass's options dataclass."""
    options_cls = pass_cls.Options
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise PlanError(f"pass {pass_cls.name!r} has no option {', '.join(unknown)}; its options are: {valid}")
    values = {}
    for key, value in raw.items():
        values[key] = _coerce(pass_cls.name, key, value, fields[key])
    return options_cls(**values)


def _coerce(pass_name: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    if not isinstance(value, str):
        return value
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        raise PlanError(f"option {key}={value!r} of pass {pass_name!r} must be of type {kind}") from None
    return value
