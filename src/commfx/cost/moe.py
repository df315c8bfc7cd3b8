"""Cost model for partitioning an MoE region into k chunks (partition_a2a's k=auto).

One MoE region is a three-stage pipeline per chunk: dispatch all-to-all, experts, combine
all-to-all. Both all-to-alls share the link, so per chunk the link is busy 2·t_c and the
experts t_f, with

    t_c = α + B / (k β)          (α: per-collective latency, B: bytes a rank sends, β: its bandwidth)
    t_f = F / (k φ)              (F: FLOPs, φ: FLOP/s)

The first chunk passes every stage, each further chunk adds the slower resource, and every
chunk costs the host γ (splitting, regrouping and merging its rows, its kernels' launches)
in series with both: the thread that does it is the one that feeds the link and the
experts (on a CPU rank, the very core that moves the bytes), so nothing hides it:

    T(k) = 2·t_c + t_f + (k - 1)·max(2·t_c, t_f) + k·γ

Backward is the same pipeline with twice the FLOPs (input and weight gradients). Small k
leaves the link and the experts idle in turn; large k pays α and γ per chunk. We evaluate
T_fw + T_bw for each candidate and keep the fastest (the smaller k on a tie). The
expressions are sympy so tests and `commfx passes` can show them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy

from ..plan import Topology

k, alpha, beta, gamma, phi, B, F = sympy.symbols("k alpha beta gamma phi B F", positive=True)


def region_time(flops) -> sympy.Expr:
    """T(k) of one pipelined dispatch -> experts -> combine region doing `flops`."""
    t_c = alpha + B / (k * beta)
    t_f = flops / (k * phi)
    return 2 * t_c + t_f + (k - 1) * sympy.Max(2 * t_c, t_f) + k * gamma


STEP_TIME = region_time(F) + region_time(2 * F)  # forward + backward of one layer

# A chunk adds a handful of small kernels (split, regroup, expert GEMMs, merge): on a GPU a
# few launches; on the CPU reference path about a millisecond of Python dispatch and row copies
# (measured: split/merge and regrouping a 768 x 128 region, benchmarks/log/notebook-2026-11.md).
CHUNK_OVERHEAD_S = {"cuda": 30e-6, "cpu": 1e-3}


def host_chunk_overhead(device_type: str) -> float:
    """The host cost of one more chunk on a device of this type (CUDA, or the CPU's figure)."""
    return CHUNK_OVERHEAD_S["cuda" if device_type == "cuda" else "cpu"]


@dataclass(frozen=True)
class MoERegion:
    """What one rank moves and computes in one MoE region (uniform routing assumed)."""

    tokens: int  # tokens per rank entering the layer
    hidden: int
    expert_hidden: int
    top_k: int
    num_experts: int
    dtype_bytes: int
    matrices: int = 3  # expert matrices of size hidden x expert_hidden (gated: gate, up, down)

    def flops(self) -> float:
        return 2.0 * self.tokens * self.top_k * self.matrices * self.hidden * self.expert_hidden

    def rows_sent(self, ep: int) -> float:
        """Rows a rank sends to other ranks in one all-to-all."""
        return self.tokens * self.top_k * (ep - 1) / ep


def link_figures(topology: Topology) -> tuple[float, float, float]:
    """(fraction of all-to-all bytes crossing nodes, per-rank bandwidth, latency) for the ep group."""
    ep = topology.expert_parallel_size
    per_node = min(topology.node_size, ep)
    if per_node >= ep:  # the ep group lives on one node
        return 0.0, topology.intra_node_bandwidth, topology.collective_overhead_s
    remote = (ep - per_node) / max(ep - 1, 1)
    return remote, topology.inter_node_bandwidth / per_node, topology.inter_node_latency_s + topology.collective_overhead_s


def substitutions(region: MoERegion, topology: Topology, chunk_overhead_s: float) -> dict:
    ep = topology.expert_parallel_size
    remote, bandwidth, latency = link_figures(topology)
    sent = region.rows_sent(ep) * region.hidden * region.dtype_bytes
    if remote == 0.0:  # one node: the intra-node copy is the link
        bytes_on_link = sent
    else:  # the inter-node share is the bottleneck
        bytes_on_link = sent * remote
    return {
        alpha: latency,
        beta: bandwidth,
        B: bytes_on_link,
        F: region.flops(),
        phi: topology.flops_per_s,
        gamma: chunk_overhead_s,
    }


def predicted_times(region: MoERegion, topology: Topology, candidates, chunk_overhead_s: float) -> dict[int, float]:
    values = substitutions(region, topology, chunk_overhead_s)
    step = STEP_TIME.subs(values)
    return {c: float(step.subs(k, c)) for c in candidates}


def choose_chunks(region: MoERegion, topology: Topology, *, max_k: int = 8, chunk_overhead_s: float = 300e-6) -> int:
    """The k in 1, 2, 4, ... max_k with the lowest predicted fw+bw time (1 if ep == 1)."""
    if topology.expert_parallel_size == 1:
        return 1
    candidates = [c for c in (1, 2, 4, 8, 16, 32) if c <= max_k and c <= max(1, region.tokens)]
    times = predicted_times(region, topology, candidates, chunk_overhead_s)
    return min(candidates, key=lambda c: (times[c], c))


def grad_chunk_bytes(topology: Topology, *, latency_share: float = 0.1, floor: int = 64 * 1024, sharded: bool = False) -> int:
    """Gradient all-reduce chunk size: the smallest whose ring all-reduce spends at most
    `latency_share` of its time on latency (smaller chunks pre-empt sooner but pay the
    2(P-1) latencies of a ring for every chunk). `sharded`: the same rule for a ZeRO bucket,
    whose all-gather or reduce-scatter sends half an all-reduce's bytes per call (a ring of
    P-1 steps), so a bucket must be twice the chunk for the same share of per-call cost."""
    world = topology.world_size
    if world == 1:
        return floor
    multi_node = topology.node_size < world
    latency = topology.collective_overhead_s / (2 * (world - 1)) + (topology.inter_node_latency_s if multi_node else 0.0)
    # A ring crosses each node's link by one edge per direction, and that edge has the node's
    # whole link (NCCL lays several rings over a node's NICs), as `commfx simulate` models it.
    bandwidth = topology.inter_node_bandwidth if multi_node else topology.intra_node_bandwidth
    ring_latency = 2 * (world - 1) * latency
    # time on the wire for chunk c: 2 (P-1)/P c / bandwidth (all-reduce) or (P-1)/P c / bandwidth
    # (all-gather, reduce-scatter); ask ring_latency <= share/(1-share) of it
    sends = (world - 1) / world * (1 if sharded else 2)
    chunk = ring_latency * bandwidth / sends * (1 - latency_share) / latency_share
    return max(floor, -(-int(chunk) // 1024) * 1024)


# ------------------------------------------------------------------------------ packing degree


@dataclass(frozen=True)
class PackingChoice:
    degree: int  # experts per device the model recommends
    compute_s: float  # a device's expert compute per chunk (forward)
    a2a_s: dict[int, float]  # a chunk's all-to-all at each degree that fits
    reason: str


def packing_degree(region: MoERegion, topology: Topology, chunks: int = 1) -> PackingChoice:
    """Lina's criterion for expert packing. A device's expert compute per chunk is the same at
    every degree (its tokens' rows, uniform routing), but one expert's share of it shrinks
    as experts spread out, and the all-to-all grows with the expert-parallel group: more
    peers, more of them on other nodes. When one expert's compute per chunk is much shorter
    than a chunk's all-to-all, the pipeline cannot hide the all-to-all. Packing d experts per
    device (an expert-parallel group of E/d ranks, replicated over the rest) shrinks the
    all-to-all; the degree is the smallest d (least replication) whose chunk all-to-all the
    device's compute per chunk covers, among the degrees that fit (d divides E, E/d divides
    the world), keeping at least two expert-parallel ranks; if none covers it, the one with
    the shortest all-to-all."""
    world, experts = topology.world_size, region.num_experts
    fits = [d for d in range(1, experts + 1) if experts % d == 0 and world % (experts // d) == 0 and (experts // d >= 2 or world == 1)]
    compute = region.flops() / chunks / topology.flops_per_s
    a2a = {}
    for d in fits:
        packed = dataclasses.replace(topology, ep=experts // d)
        a2a[d] = 0.0 if packed.expert_parallel_size == 1 else float((alpha + B / (k * beta)).subs(substitutions(region, packed, 0.0)).subs(k, chunks))
    if not fits:
        return PackingChoice(experts, compute, a2a, f"no degree fits {experts} experts on {world} ranks")
    covered = [d for d in fits if a2a[d] <= compute]
    degree = covered[0] if covered else min(fits, key=lambda d: (a2a[d], d))
    one = compute / degree
    reason = (
        f"one expert's compute per chunk {one * 1e6:.3g} us vs a chunk's all-to-all {a2a[degree] * 1e6:.3g} us at {degree} "
        f"expert(s) per device (expert-parallel group of {experts // degree}); "
        + (f"the device's compute per chunk ({compute * 1e6:.3g} us) covers it" if covered else "the shortest all-to-all of the degrees that fit")
        + "; all-to-all per degree: " + ", ".join(f"{d}: {a2a[d] * 1e6:.3g} us" for d in fits)
    )
    return PackingChoice(degree, compute, a2a, reason)
