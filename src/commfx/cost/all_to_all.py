"""Cost of one expert all-to-all, flat or hierarchical (hierarchical_a2a:enabled=auto, `commfx simulate`).

One rank of an expert-parallel group of P ranks, R of them on each of N = P/R nodes, sends
`rows` rows of `row_bytes` spread evenly over the group (uniform routing, itself included).
An all-to-all is a sequence of exchanges; each costs

    t = o + λ + m·μ + max(B_inter / β_inter, B_intra / β_intra)

(o: per-collective overhead, λ: the latency of the slower link it uses, m: messages this
rank sends, μ: per-message overhead, B_inter: bytes on this node's inter-node link, all its
ranks together, β_inter that link's rate; B_intra, β_intra: one rank's intra-node path).

- **flat** (one all_to_all_single): one exchange, m = P - 1 messages; B_inter = S·(P-R)/P·R,
  B_intra = S·(R-1)/P for a payload S = rows·row_bytes.
- **hierarchical** (runtime/hierarchical_a2a.py): three exchanges in turn. (1) intra-node,
  m = R - 1: the rows for node-mates, B_intra = S·(R-1)/P. (2) inter-node, m = N - 1, one
  message to each remote node: B_inter = S·(P-R)/P·R·(1 - d) plus a 4-byte index per row
  where rows repeat (d: the share of the rows bound for a remote node that repeat one already
  bound there, sent once). (3) intra-node, m = R - 1: the rows received for node-mates,
  B_intra = S·(N-1)(R-1)/P.

Duplicates under uniform routing: a token picks k of E experts, E/N on each node. The flat
all-to-all sends it to node m once per expert there, k/N rows on average; the hierarchical
once if any of them is there, 1 - C(E - E/N, k)/C(E, k). So

    d = 1 - N·(1 - C(E - E/N, k) / C(E, k)) / k

(0 for k = 1; 6/28 at E = 8, k = 2, N = 2; 0.75 at E = 64, k = 8, N = 2). Only a forward
dispatch repeats rows: its backward, the combine and packed rows (which carry each rank's own
routing weights) are distinct. A site (an MoE block's dispatch or combine) runs one algorithm
forward and backward, so the choice compares fw + bw; ties choose flat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan import Topology

ALGORITHMS = ("flat", "hierarchical")
INDEX_BYTES = 4  # the int32 index per row a deduplicated inter-node message carries


@dataclass(frozen=True)
class Links:
    """The figures an all-to-all's cost reads (from a Topology, or a simulated cluster's links)."""

    inter_bandwidth: float  # bytes/s of one node's link (its ranks share it)
    inter_latency_s: float
    intra_bandwidth: float  # bytes/s of one rank's path inside its node
    intra_latency_s: float
    overhead_s: float  # per exchange: launch, software stack, waiting for the slowest peer
    message_overhead_s: float  # per message a rank sends

    @classmethod
    def of(cls, topology: Topology) -> Links:
        return cls(topology.inter_node_bandwidth, topology.inter_node_latency_s, topology.intra_node_bandwidth,
                   topology.intra_node_latency_s, topology.collective_overhead_s, topology.message_overhead_s)


@dataclass(frozen=True)
class Exchange:
    """One exchange of an all-to-all: bytes on this node's inter-node link (all its ranks), on
    one rank's intra-node path, and the messages one rank sends."""

    inter_bytes: float
    intra_bytes: float
    messages: int

    def fixed_s(self, links: Links) -> float:
        """What the exchange costs before its bytes: overhead, latency, messages."""
        latency = links.inter_latency_s if self.inter_bytes else links.intra_latency_s
        return links.overhead_s + latency + self.messages * links.message_overhead_s

    def wire_s(self, links: Links, share: float = 1.0) -> float:
        """Its bytes on the slower link, with `share` of each link."""
        inter = self.inter_bytes / (links.inter_bandwidth * share) if self.inter_bytes else 0.0
        intra = self.intra_bytes / (links.intra_bandwidth * share) if self.intra_bytes else 0.0
        return max(inter, intra)


@dataclass(frozen=True)
class A2AShape:
    """One all-to-all as one rank of the group sees it."""

    rows: float  # rows this rank sends, itself included
    row_bytes: float
    ranks: int  # P
    per_node: int  # R: ranks of the group on each node
    duplicate_share: float = 0.0  # d: of the rows bound for a remote node, those repeating one already bound there

    @property
    def nodes(self) -> int:
        return max(1, self.ranks // max(1, self.per_node))


def reach_share(num_experts: int, top_k: int, groups: int) -> float:
    """The chance that a token's top-k experts (uniform routing) include one of a given group's,
    with the experts spread evenly over `groups` groups (ranks or nodes): 1 - C(E - E/G, k)/C(E, k)."""
    k = min(top_k, num_experts)
    return 1.0 - math.comb(num_experts - num_experts // groups, k) / math.comb(num_experts, k)


def duplicate_share(num_experts: int, top_k: int, nodes: int) -> float:
    """d for uniform top-k routing over `num_experts` experts spread evenly over `nodes` nodes:
    1 - (rows the hierarchical all-to-all sends to a remote node) / (rows the flat one sends)."""
    if nodes < 2 or top_k < 2 or num_experts % nodes:
        return 0.0
    return max(0.0, 1.0 - reach_share(num_experts, top_k, nodes) * nodes / min(top_k, num_experts))


def exchanges(algorithm: str, shape: A2AShape) -> tuple[Exchange, ...]:
    """The exchanges `algorithm` makes for `shape`, in the order they run."""
    P, R, N = shape.ranks, min(shape.per_node, shape.ranks), shape.nodes
    payload = shape.rows * shape.row_bytes
    if P <= 1:
        return ()
    off_node = payload * (P - R) / P * R  # this node's ranks together, on its link
    if algorithm == "flat" or N < 2:  # a group on one node: the runtime runs flat
        return (Exchange(off_node, payload * (R - 1) / P, P - 1),)
    if algorithm != "hierarchical":
        raise ValueError(f"unknown all-to-all algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    d = shape.duplicate_share
    index = INDEX_BYTES * shape.rows * (P - R) / P * R if d > 0 else 0.0
    inter = Exchange(off_node * (1 - d) + index, 0.0, N - 1)
    if R == 1:  # no node-mates: only the inter-node exchange
        return (inter,)
    return (Exchange(0.0, payload * (R - 1) / P, R - 1), inter, Exchange(0.0, payload * (N - 1) * (R - 1) / P, R - 1))


def a2a_seconds(algorithm: str, shape: A2AShape, links: Links) -> float:
    """Predicted time of one all-to-all (its exchanges one after the other, alone on the links)."""
    return sum(e.fixed_s(links) + e.wire_s(links) for e in exchanges(algorithm, shape))


@dataclass(frozen=True)
class SiteChoice:
    """The algorithm for one all-to-all site (forward and its backward) and why."""

    algorithm: str
    flat_s: float  # predicted forward + backward
    hierarchical_s: float
    duplicate_share: float


def choose_algorithm(forward: A2AShape, links: Links) -> SiteChoice:
    """Flat or hierarchical for a site whose forward all-to-all is `forward`; its backward is
    the reverse exchange of the same sizes with no repeated rows. Ties choose flat."""
    backward = A2AShape(forward.rows, forward.row_bytes, forward.ranks, forward.per_node)
    times = {a: a2a_seconds(a, forward, links) + a2a_seconds(a, backward, links) for a in ALGORITHMS}
    # a relative margin so that rounding never flips a tie to hierarchical
    pick = "hierarchical" if forward.nodes > 1 and times["hierarchical"] < times["flat"] * (1 - 1e-9) else "flat"
    return SiteChoice(pick, times["flat"], times["hierarchical"], forward.duplicate_share)
