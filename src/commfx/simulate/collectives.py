"""What one collective costs on a cluster: the bytes it puts on each link and its latency.

Every rank runs the same program (SPMD), so one rank's collective stands for all of its
node's: the inter-node link of a node carries what all of the node's ranks send off-node.
The algorithms are the usual ones (each rank's payload S, a group of P ranks):

- all-to-all, pairwise: S/P to each peer; the off-node share crosses the node's link.
- all-to-all, hierarchical (hierarchical_a2a, where the program runs it): three exchanges in
  turn, each with its own overhead and latency: the rows for node-mates, one message per
  remote node without the rows that repeat (a forward dispatch's tokens bound for several
  ranks of one node), the forwarded rows to node-mates. Bytes, messages and repeats are
  `cost.all_to_all`'s, the formula hierarchical_a2a:enabled=auto chooses by.
- every all-to-all also pays a per-message overhead for each peer it sends to.
- all-to-all under a locality gate: `remote_share` of the payload leaves the node (the
  gate's cap on off-node tokens) instead of the uniform share.
- all-reduce, ring: 2 (P-1)/P S through every ring edge, 2 (P-1) latency steps; one ring
  edge per direction leaves each node, so the node's link carries 2 (P-1)/P S.
- all-reduce, tree: 2 S through the node's link, 2 log2 P steps.
- all-gather and reduce-scatter, ring (S the whole buffer): half an all-reduce, (P-1)/P S
  and P-1 steps.
- point-to-point: S on the one link between the two ranks, at the link's raw rate (one
  stream and no algorithm steps: a pipeline's 512 KB sends ran at 0.93-1.1 of the emulated
  100 Mbit/s link, where gloo's collectives reach the preset's 0.7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cost.all_to_all import A2AShape, Exchange, Links, exchanges
from ..plan import Topology
from .cluster import Cluster


@dataclass(frozen=True)
class LinkLoad:
    """Bytes one collective puts on this node's inter-node link (all its ranks together) and
    on one rank's intra-node path, and its latency-bearing steps."""

    inter_bytes: float
    intra_bytes: float
    steps: int
    raw_rate: bool = False  # a point-to-point stream: the link's bandwidth, not its collective efficiency
    alone: bool = False  # a group of one rank: the runtime calls nothing
    messages: int = 0  # messages one rank sends (each pays the cluster's per-message overhead)
    exchanges: tuple[Exchange, ...] = ()  # a collective of exchanges in turn (the hierarchical all-to-all)

    @classmethod
    def of_exchanges(cls, parts: tuple[Exchange, ...]) -> LinkLoad:
        return cls(sum(e.inter_bytes for e in parts), sum(e.intra_bytes for e in parts), len(parts),
                   messages=sum(e.messages for e in parts), exchanges=parts)

    def seconds(self, cluster: Cluster, share: float = 1.0) -> float:
        """Time on the wire with `share` of each link (others in flight take the rest)."""
        if self.exchanges:
            return sum(e.wire_s(links_of(cluster), share) for e in self.exchanges)
        inter_link, intra_link = cluster.inter_node, cluster.intra_node
        inter_rate = inter_link.bandwidth if self.raw_rate else inter_link.effective_bandwidth
        intra_rate = intra_link.bandwidth if self.raw_rate else intra_link.effective_bandwidth
        inter = self.inter_bytes / (inter_rate * share) if self.inter_bytes else 0.0
        intra = self.intra_bytes / (intra_rate * share) if self.intra_bytes else 0.0
        return max(inter, intra)

    def latency(self, cluster: Cluster) -> float:
        if self.alone:
            return 0.0
        if self.exchanges:
            return sum(e.fixed_s(links_of(cluster)) for e in self.exchanges)
        link = cluster.inter_node if self.inter_bytes else cluster.intra_node
        return cluster.collective_overhead_s + self.steps * link.latency_s + self.messages * cluster.message_overhead_s


def links_of(cluster: Cluster) -> Links:
    """The cluster's links as `cost.all_to_all` reads them (what `topology_for` gives a plan)."""
    inter, intra = cluster.inter_node, cluster.intra_node
    return Links(inter.effective_bandwidth, inter.latency_s, intra.effective_bandwidth, intra.latency_s,
                 cluster.collective_overhead_s, cluster.message_overhead_s)


def group_of_rank0(topology: Topology, group: str) -> list[int]:
    """The ranks of rank 0's group called `group` (every group of a kind has the same shape)."""
    groups = topology.process_groups()
    if group not in groups:
        raise ValueError(f"process group {group!r} is not in the plan (known: {', '.join(sorted(groups))})")
    return next(g for g in groups[group] if 0 in g)


def link_load(kind: str, payload: float, group: list[int], topology: Topology, cluster: Cluster, remote_share: float | None = None,
              algorithm: str = "flat", row_bytes: float = 0.0, duplicate_share: float = 0.0) -> LinkLoad:
    """`kind`: all_to_all | all_reduce | all_gather | reduce_scatter | send. `payload`: bytes
    this rank contributes (the whole buffer for all-gather and reduce-scatter). An all-to-all's
    `algorithm` (flat | hierarchical), its rows' bytes and the share of its off-node rows that
    repeat (`cost.all_to_all.A2AShape`)."""
    size = len(group)
    if size <= 1 or payload <= 0:
        return LinkLoad(0.0, 0.0, 0, alone=size <= 1)
    node = topology.node_of(group[0])
    remote = sum(1 for r in group if topology.node_of(r) != node)
    local_peers = size - remote - 1
    per_node = topology.node_size
    if kind == "all_to_all":
        per_peer = payload / size
        if remote_share is not None and remote and remote_share < remote / size:
            local = payload * (1 - remote_share) * local_peers / (local_peers + 1)
            return LinkLoad(payload * remote_share * per_node, local, 1, messages=size - 1)
        if algorithm == "hierarchical" and remote:
            rows = payload / row_bytes if row_bytes else payload
            return LinkLoad.of_exchanges(exchanges("hierarchical", A2AShape(rows, row_bytes or 1.0, size, local_peers + 1, duplicate_share)))
        return LinkLoad(per_peer * remote * per_node, per_peer * local_peers, 1, messages=size - 1)
    if kind == "all_reduce":
        if cluster.all_reduce == "tree" and remote:
            return LinkLoad(2.0 * payload, 2.0 * payload * (size - 1) / size, 2 * math.ceil(math.log2(size)))
        wire = 2.0 * (size - 1) / size * payload
        return LinkLoad(wire if remote else 0.0, wire if local_peers else 0.0, 2 * (size - 1))
    if kind in ("all_gather", "reduce_scatter"):
        wire = (size - 1) / size * payload
        return LinkLoad(wire if remote else 0.0, wire if local_peers else 0.0, size - 1)
    if kind == "send":
        return LinkLoad(payload if remote else 0.0, 0.0 if remote else payload, 1, raw_rate=True)
    raise ValueError(f"unknown collective kind {kind!r}")
