"""Measure the machine a plan runs on, for the cost models (`Plan(machine="measure")`).

The cost models (partition_a2a's k and gradient chunk, pack_experts' degree,
split_embedding_comm's strategy, the simulator) read three figures from the topology: a
rank's compute rate, the fixed cost of one collective, and the bandwidth of the link the
expert all-to-all crosses. Written defaults describe a GPU cluster; on another machine they
make the wrong choice (on this project's CPU cluster, k=auto sent the whole all-to-all at
once because a collective looked free). So before compiling, every rank times:

- its compute: the experts' forward, both grouped GEMMs (the kernel the expert ops run:
  Triton on a GPU, the torch loop on a CPU), at the model's own expert shape and rows per
  expert (`expert_work_shape`, read from the lifted graph) in its dtype, best of a few;
- the expert-parallel group's all-to-all at two sizes, best of a few each: the small one's
  time is the per-call cost, the difference over the bytes the large one sends to other
  nodes (or, on one node, to other ranks) is the link. The large size grows (to at most
  16 MiB per peer) until its wire time stands clear of the per-call cost.

The ranks then agree on the slowest of each figure (an all-gather), so every rank compiles
the same graph. A few hundred milliseconds, once per `distribute`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time

import torch

from ..plan import Topology
from .comm import CommScheduler

DEFAULT_SHAPE = (4, 64, 1024, 1024, 2)  # experts, rows per expert, hidden, expert width, matrices (gate+up, down): a model without MoE
SMALL_BYTES, LARGE_BYTES, LARGEST_BYTES = 64, 256 * 1024, 16 << 20  # per peer, the all-to-all sizes
REPEATS = 3
NOTE = "machine measured on the ranks"  # how a program's notes say which figures it was compiled with


@dataclasses.dataclass(frozen=True)
class MachineFigures:
    flops_per_s: float
    collective_s: float  # one small collective on the expert-parallel group, end to end
    link_bytes_per_s: float  # per rank, over the link the all-to-all's remote bytes cross
    spans_nodes: bool

    def describe(self) -> str:
        link = "inter-node" if self.spans_nodes else "intra-node"
        return (f"{NOTE}: {self.flops_per_s / 1e9:,.1f} GFLOP/s per rank, {self.collective_s * 1e3:.2f} ms "
                f"per collective, {self.link_bytes_per_s * 8 / 1e6:,.0f} Mbit/s per rank {link}")

    @classmethod
    def parse(cls, note: str) -> MachineFigures | None:
        """The figures `describe` wrote (to its rounding), or None if `note` is not one of its lines."""
        found = re.fullmatch(rf"{NOTE}: ([\d,.]+) GFLOP/s per rank, ([\d.]+) ms per collective, ([\d,.]+|inf) Mbit/s per rank (inter|intra)-node",
                             note.strip())
        if found is None:
            return None
        rate, per_call, link, where = found.groups()
        link_bytes = float("inf") if link == "inf" else float(link.replace(",", "")) * 1e6 / 8
        return cls(float(rate.replace(",", "")) * 1e9, float(per_call) * 1e-3, link_bytes, where == "inter")


def measure(scheduler: CommScheduler, topology: Topology, dtype: torch.dtype, device: torch.device, shape=DEFAULT_SHAPE) -> MachineFigures:
    """Time this machine (collectively: every rank calls it) and agree on the slowest figures;
    `shape` is the experts' work (see `expert_work_shape`)."""
    flops = expert_rate(dtype, device, *shape)
    group = "ep" if "ep" in scheduler.groups and scheduler.group("ep").size > 1 else "world"
    handle = scheduler.group(group)
    spans = len({topology.node_of(r) for r in handle.ranks}) > 1
    collective_s, link = 0.0, float("inf")
    if handle.size > 1:
        before = copy.deepcopy(scheduler.stats)  # the probe's bytes are nobody's traffic
        small = _all_to_all_time(scheduler, group, handle.size, SMALL_BYTES, device)
        slowest_small = _agreed_max(scheduler, small)
        size, large = LARGE_BYTES, _all_to_all_time(scheduler, group, handle.size, LARGE_BYTES, device)
        while _agreed_max(scheduler, large) < 4 * slowest_small and size < LARGEST_BYTES:  # every rank decides alike
            size *= 8
            large = _all_to_all_time(scheduler, group, handle.size, size, device)
        scheduler.stats = before
        mine = topology.node_of(scheduler.rank)
        peers = [r for r in handle.ranks if r != scheduler.rank and (topology.node_of(r) != mine or not spans)]
        collective_s, link = small, size * len(peers) / max(large - small, 1e-9)
    figures = scheduler.all_gather_object((flops, collective_s, link))
    return MachineFigures(min(f[0] for f in figures), max(f[1] for f in figures), min(f[2] for f in figures), spans)


def measured_topology(topology: Topology, figures: MachineFigures, host_chunk_s: float = 0.0) -> Topology:
    """`topology` with the measured figures where its cost models read them. One more chunk
    of a partitioned MoE region costs a collective's fixed cost and `host_chunk_s` of host
    work (its split, regroup and merge, its kernels' launches: the device's typical figure,
    `cost.moe.CHUNK_OVERHEAD_S`; 0 for runs compiled before it counted)."""
    per_node = min(topology.node_size, topology.expert_parallel_size)
    changes: dict = {"flops_per_s": figures.flops_per_s, "collective_overhead_s": figures.collective_s,
                     "chunk_overhead_s": figures.collective_s + host_chunk_s}
    if figures.link_bytes_per_s != float("inf"):
        if figures.spans_nodes:  # cost models divide a node's link among its ranks
            changes.update(inter_node_bandwidth=figures.link_bytes_per_s * per_node, inter_node_latency_s=0.0)
        else:
            changes["intra_node_bandwidth"] = figures.link_bytes_per_s
    return dataclasses.replace(topology, **changes)


def expert_work_shape(program, tokens: int) -> tuple[int, int, int, int, int]:
    """(experts, rows per expert, hidden, expert width, matrices) of the first MoE region of a
    lifted program, with `tokens` per rank routed top-k; DEFAULT_SHAPE without one."""
    blocks = program.regions.moe_blocks
    if not blocks:
        return DEFAULT_SHAPE
    block = blocks[0]
    gate_up, down = program.gm.get_parameter(block.gate_up), program.gm.get_parameter(block.down)
    experts, hidden, width = down.shape[0], down.shape[1], down.shape[2]
    rows = max(1, tokens * block.top_k // block.num_experts)
    return experts, rows, hidden, width, gate_up.shape[1] // width + 1


def expert_rate(dtype: torch.dtype, device: torch.device, experts: int, rows: int, hidden: int, width: int, matrices: int,
                repeats: int = REPEATS) -> float:
    """FLOP/s of the experts' two grouped GEMMs at this shape, best of `repeats` timings."""
    from ..kernels import grouped_mm

    x = torch.randn(experts * rows, hidden, dtype=dtype, device=device)
    up = torch.randn(experts, (matrices - 1) * width, hidden, dtype=dtype, device=device)
    down = torch.randn(experts, hidden, width, dtype=dtype, device=device)
    counts = torch.full((experts,), rows, dtype=torch.int64, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up (and compiles the kernels on a GPU)
        _sync(device)
        start = time.perf_counter()
        inner = grouped_mm(x, up, counts)
        grouped_mm(inner[:, :width].contiguous(), down, counts)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * experts * rows * hidden * width * matrices / best


def _agreed_max(scheduler: CommScheduler, seconds: float) -> float:
    return max(scheduler.all_gather_object(seconds))


def _all_to_all_time(scheduler: CommScheduler, group: str, size: int, per_peer: int, device: torch.device) -> float:
    rows = max(1, per_peer // 4)
    x = torch.zeros(rows * size, dtype=torch.float32, device=device)
    splits = [rows] * size
    best = float("inf")
    for _ in range(REPEATS + 1):
        _sync(device)
        start = time.perf_counter()
        scheduler.all_to_all(x, splits, splits, group, kind="machine_probe")
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
