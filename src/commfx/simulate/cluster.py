"""Cluster descriptions: the device and link figures `commfx simulate` projects a plan onto.

A cluster is a TOML file (presets ship in `commfx/clusters/`: `emulated`, `h100`, `a100`)
with the layout (`nodes`, `ranks_per_node`), the device (`[device]`: peak FLOP/s per dtype,
memory bandwidth and size, efficiencies, per-op overhead), the links (`[intra_node]`,
`[inter_node]`: bandwidth in bytes/s per direction, latency; the emulated cluster gives
`link = "RATE[,LATENCY]"` in tc's units instead) and the collectives (`[collectives]`:
per-call overhead, optionally the per-message overhead, all-reduce and all-to-all algorithms), and `fitted_to`: the bench runs
whose measurements set its figures (none for datasheet presets). A missing or wrong field is
an error naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..bench.links import LinkSpec
from ..plan import PlanError, Topology

PRESETS_DIR = Path(__file__).resolve().parent.parent / "clusters"
ALL_REDUCE_ALGORITHMS = ("ring", "tree")
ALL_TO_ALL_ALGORITHMS = ("pairwise", "hierarchical")
MESSAGE_OVERHEAD_S = Topology.message_overhead_s  # [collectives] message_overhead_s when a file leaves it out


@dataclass(frozen=True)
class Device:
    name: str
    flops: dict[str, float]  # dtype ("fp32", "bf16") -> peak FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    compute_efficiency: float
    memory_efficiency: float
    op_overhead_s: float
    shares_cores: bool = False  # ranks run on one machine's cores (the emulated cluster): more ranks than cores share them
    slowdown: float = 1.0  # ranks per core, when they share (`Cluster.with_layout`)

    def op_seconds(self, flops: float, nbytes: float, dtype: str = "fp32") -> float:
        """Roofline: the slower of the op's arithmetic and its memory traffic, plus launch."""
        peak = self.flops.get(dtype) or self.flops["fp32"]
        seconds = self.op_overhead_s + max(flops / (peak * self.compute_efficiency), nbytes / (self.memory_bandwidth * self.memory_efficiency))
        return seconds * self.slowdown


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, each direction (inter-node: one node's link, shared by its ranks)
    latency_s: float
    efficiency: float = 1.0

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    source: str  # the file it came from
    nodes: int
    ranks_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link
    collective_overhead_s: float
    all_reduce: str
    all_to_all: str
    message_overhead_s: float = MESSAGE_OVERHEAD_S  # per message a collective sends to a peer
    # `commfx bench` JSON files (names under benchmarks/) whose measurements set this
    # cluster's figures: validation against them is in-sample, so prediction errors leave them out
    fitted_to: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_layout(self, nodes: int | None = None, ranks_per_node: int | None = None, inter_node: str | None = None,
                    cores: int | None = None) -> Cluster:
        """This cluster at another size, or (any cluster) with a tc link spec for its inter-node
        link. A device that shares one machine's `cores` (default: this machine's) among the
        ranks runs each op that many times slower per rank beyond one core each."""
        link = self.inter_node
        if inter_node is not None:
            spec = LinkSpec.parse(inter_node)
            link = Link(spec.rate_bits / 8, spec.latency_s, self.inter_node.efficiency)
        nodes, ranks_per_node = nodes or self.nodes, ranks_per_node or self.ranks_per_node
        device = self.device
        if device.shares_cores:
            device = dataclasses.replace(device, slowdown=max(1.0, nodes * ranks_per_node / (cores or os.cpu_count() or 1)))
        return dataclasses.replace(self, nodes=nodes, ranks_per_node=ranks_per_node, inter_node=link, device=device)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} node(s) x {self.ranks_per_node} rank(s), {self.device.name}, "
            f"inter-node {self.inter_node.bandwidth * 8 / 1e9:.3g} Gbit/s, intra-node {self.intra_node.bandwidth / 1e9:.3g} GB/s"
        )


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_cluster(name_or_path: str) -> Cluster:
    """A preset by name (`emulated`, `h100`, `a100`) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PRESETS_DIR / f"{name_or_path}.toml"
        if not path.exists():
            raise PlanError(f"unknown cluster {name_or_path!r}: give a preset ({', '.join(presets())}) or a path to a .toml file")
    if not path.is_file():
        raise PlanError(f"cluster file {name_or_path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise PlanError(f"cluster file {path}: not valid TOML: {error}") from None
    return parse_cluster(data, str(path))


def parse_cluster(data: dict, source: str) -> Cluster:
    fields = _Fields(data, source)
    device = fields.table("device")
    flops = device.get("flops", "device")
    if not isinstance(flops, dict) or "fp32" not in flops:
        raise PlanError(f"cluster file {source}: field device.flops must be a table with at least fp32 (peak FLOP/s per dtype)")
    dev = Device(
        name=str(device.get("name", "device")), flops={k: fields.positive(v, f"device.flops.{k}") for k, v in flops.items()},
        memory_bandwidth=fields.number(device, "device", "memory_bandwidth"), memory_bytes=fields.number(device, "device", "memory_bytes"),
        compute_efficiency=fields.share(device, "device", "compute_efficiency"), memory_efficiency=fields.share(device, "device", "memory_efficiency"),
        op_overhead_s=fields.number(device, "device", "op_overhead_s", allow_zero=True),
        shares_cores=bool(device.get("shares_cores", False)),
    )
    intra = fields.table("intra_node")
    inter = fields.table("inter_node")
    if "link" in inter:
        try:
            spec = LinkSpec.parse(inter["link"])
        except ValueError as error:
            raise PlanError(f"cluster file {source}: field inter_node.link: {error}") from None
        inter_link = Link(spec.rate_bits / 8, spec.latency_s, fields.share(inter, "inter_node", "efficiency", default=1.0))
    else:
        inter_link = Link(
            fields.number(inter, "inter_node", "bandwidth"), fields.number(inter, "inter_node", "latency_s", allow_zero=True),
            fields.share(inter, "inter_node", "efficiency", default=1.0),
        )
    collectives = fields.table("collectives")
    all_reduce = fields.choice(collectives, "collectives", "all_reduce", ALL_REDUCE_ALGORITHMS)
    all_to_all = fields.choice(collectives, "collectives", "all_to_all", ALL_TO_ALL_ALGORITHMS)
    return Cluster(
        name=str(data.get("name", Path(source).stem)), description=str(data.get("description", "")), source=source,
        nodes=int(fields.number(data, "", "nodes")), ranks_per_node=int(fields.number(data, "", "ranks_per_node")), device=dev,
        intra_node=Link(fields.number(intra, "intra_node", "bandwidth"), fields.number(intra, "intra_node", "latency_s", allow_zero=True),
                        fields.share(intra, "intra_node", "efficiency", default=1.0)),
        inter_node=inter_link, collective_overhead_s=fields.number(collectives, "collectives", "overhead_s", allow_zero=True),
        all_reduce=all_reduce, all_to_all=all_to_all, fitted_to=fields.names("fitted_to"),
        message_overhead_s=fields.number(collectives, "collectives", "message_overhead_s", allow_zero=True)
        if "message_overhead_s" in collectives else MESSAGE_OVERHEAD_S,
    )


class _Fields:
    """Reads fields of one cluster file; every error names the file and the field."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source

    def fail(self, field: str, why: str) -> PlanError:
        return PlanError(f"cluster file {self.source}: field {field} {why}")

    def table(self, name: str) -> dict:
        value = self.data.get(name)
        if not isinstance(value, dict):
            raise self.fail(name, "is missing (a [" + name + "] table)" if value is None else "must be a table")
        return value

    def number(self, table: dict, where: str, key: str, *, allow_zero: bool = False) -> float:
        name = f"{where}.{key}" if where else key
        if key not in table:
            raise self.fail(name, "is missing")
        return self.positive(table[key], name, allow_zero=allow_zero)

    def positive(self, value, name: str, *, allow_zero: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
            raise self.fail(name, f"must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
        return float(value)

    def share(self, table: dict, where: str, key: str, default: float | None = None) -> float:
        if key not in table and default is not None:
            return default
        value = self.number(table, where, key)
        if value > 1:
            raise self.fail(f"{where}.{key}", f"is a share of the peak: at most 1, got {value!r}")
        return value

    def names(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, f"must be a list of file names, got {value!r}")
        return tuple(value)

    def choice(self, table: dict, where: str, key: str, choices: tuple[str, ...]) -> str:
        value = table.get(key, choices[0])
        if value not in choices:
            raise self.fail(f"{where}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
        return value
