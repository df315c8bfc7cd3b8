"""Cost model of one embedding table's communication per step (split_embedding_comm).

Bytes are what one rank sends per step, counted the way the comm scheduler counts them
(a ring all-reduce sends 2 (P-1)/P of the buffer; an all-to-all sends each peer its rows).
A step touches at most U = min(tokens per rank, rows) distinct rows per rank (the bound
is reached by uniform ids; real text repeats words, so U is an upper bound):

- dense:  all-reduce of the [V, H] gradient:        2 (P-1)/P * V H e
- sparse: every rank sends its coalesced pairs to every other rank (one id + one row each):
                                                    (P-1) * U (H e + 8)      + counts
- shard:  ids to owners, rows back, row gradients to owners, each a (P-1)/P share of U:
                                                    (P-1)/P * U (2 H e + 8)  + counts
An untied LM head whose logits feed only the loss (`lift_heads`) has its own two choices:
- dense: the all-reduce of its [V, H] gradient, as for a table;
- shard: vocabulary-parallel (`ops/vocab_parallel.py`): every rank's hidden states and
  labels to every rank, per token two statistics to every rank, and backward one row of
  hidden-state gradient per other rank's token:    (P-1) T (2 H e + 8 + 2 P e) + counts.
Time is collectives x (latency + per-collective overhead) + bytes / link bandwidth, with
the topology's figures (the inter-node link when ranks span nodes). The sharded table's
two forward all-to-alls sit on the critical path; the others overlap backward.

Under `schedule=2d` the row gradients go in two parts, the rows the next batch reads first
(`next_share`: under the same uniform ids, the share of a rank's touched rows that R ranks'
next batches of T tokens read is 1 - (1 - 1/V)^(T R)), then the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Topology

STRATEGIES = ("sparse", "shard", "dense")  # tie-break order: fewest bytes on the critical path first
ID_BYTES = 8


@dataclass(frozen=True)
class Estimate:
    strategy: str
    bytes: int  # sent by one rank per step
    collectives: int
    seconds: float
    applicable: bool = True
    why_not: str = ""

    def describe(self) -> str:
        if not self.applicable:
            return f"{self.strategy} n/a ({self.why_not})"
        return f"{self.strategy} {_human(self.bytes)}/{self.seconds * 1e3:.3g} ms"


def estimate(rows: int, width: int, dtype_bytes: int, tokens: int, topology: Topology, parts: int) -> dict[str, Estimate]:
    """Per-strategy bytes and time of one table; `parts` is the row-sharding group's size."""
    world = topology.world_size
    unique = min(tokens, rows)
    row = width * dtype_bytes
    spans_nodes = topology.ranks_per_node and topology.ranks_per_node < world
    bandwidth = topology.inter_node_bandwidth if spans_nodes else topology.intra_node_bandwidth
    per_collective = topology.inter_node_latency_s + topology.collective_overhead_s
    counts = (world - 1) * ID_BYTES

    def make(strategy, nbytes, collectives, applicable=True, why_not=""):
        seconds = collectives * per_collective + nbytes / bandwidth if world > 1 else 0.0
        return Estimate(strategy, int(nbytes) if world > 1 else 0, collectives if world > 1 else 0, seconds, applicable, why_not)

    dense = make("dense", 2 * (world - 1) * rows * row / world, 2 * (world - 1))
    sparse = make("sparse", (world - 1) * unique * (row + ID_BYTES) + counts, 3)
    why_not = shard_problem(rows, parts)
    share = (parts - 1) / parts
    shard = make("shard", share * unique * (2 * row + ID_BYTES) + (parts - 1) * ID_BYTES, 4, not why_not, why_not)
    return {e.strategy: e for e in (sparse, shard, dense)}


def estimate_head(rows: int, width: int, dtype_bytes: int, tokens: int, topology: Topology, parts: int) -> dict[str, Estimate]:
    """Bytes and time of an LM head per step: dense all-reduce or split over the vocabulary."""
    world = topology.world_size
    spans_nodes = topology.ranks_per_node and topology.ranks_per_node < world
    bandwidth = topology.inter_node_bandwidth if spans_nodes else topology.intra_node_bandwidth
    per_collective = topology.inter_node_latency_s + topology.collective_overhead_s

    def make(strategy, nbytes, collectives, why_not=""):
        seconds = collectives * per_collective + nbytes / bandwidth if world > 1 else 0.0
        return Estimate(strategy, int(nbytes) if world > 1 else 0, collectives if world > 1 else 0, seconds, not why_not, why_not)

    dense = make("dense", 2 * (world - 1) * rows * width * dtype_bytes / world, 2 * (world - 1))
    per_token = 2 * width * dtype_bytes + ID_BYTES + 2 * parts * dtype_bytes
    shard = make("shard", (parts - 1) * (tokens * per_token + 2 * ID_BYTES), 6, shard_problem(rows, parts))
    return {"shard": shard, "dense": dense}


def next_share(rows: int, tokens: float, readers: int = 1) -> float:
    """The share of one rank's touched rows that `readers` ranks' next batches of `tokens`
    ids each also read, under uniform ids over `rows` rows (schedule=2d's urgent part)."""
    if rows <= 0 or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - 1.0 / rows) ** (tokens * max(readers, 1))


def choose(estimates: dict[str, Estimate]) -> Estimate:
    """The fastest applicable strategy (ties: the order of STRATEGIES)."""
    candidates = [estimates[s] for s in STRATEGIES if s in estimates and estimates[s].applicable]
    return min(candidates, key=lambda e: (e.seconds, STRATEGIES.index(e.strategy)))


def shard_problem(rows: int, parts: int) -> str:
    """Why a table cannot be row-sharded over `parts` ranks ('' when it can)."""
    if parts < 2:
        return "one rank: nothing to shard"
    if rows < parts:
        return f"{rows} rows are too few to shard over {parts} ranks (each needs at least one)"
    if rows % parts:
        return f"{rows} rows do not divide over {parts} ranks"
    return ""


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.3g} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    return f"{nbytes} B"
