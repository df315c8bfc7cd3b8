"""The topology's figures the cost models read, as a record.

Automatic choices (partition_a2a's k and gradient chunk, shard_states' bucket size,
split_embedding_comm's strategy, hierarchical_a2a's algorithm per all-to-all) are made from these fields of `Topology` and from
nothing else of the machine. `commfx bench` records them with each plan (measured on the
ranks or given), and `commfx simulate` compiles with a run's record so that it chooses
what the run chose.
"""

from __future__ import annotations

import dataclasses

from ..plan import Topology

FIGURES = (
    "flops_per_s", "collective_overhead_s", "chunk_overhead_s",
    "inter_node_bandwidth", "inter_node_latency_s", "intra_node_bandwidth",
    "intra_node_latency_s", "message_overhead_s",
)


def figures_of(topology: Topology) -> dict[str, float]:
    """The cost models' figures of `topology`, by field name."""
    return {name: float(getattr(topology, name)) for name in FIGURES}


def with_figures(topology: Topology, figures: dict[str, float]) -> Topology:
    """`topology` (its layout kept) with `figures` where the cost models read them."""
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        raise ValueError(f"not cost-model figures of a topology: {', '.join(unknown)} (they are {', '.join(FIGURES)})")
    return dataclasses.replace(topology, **{name: float(value) for name, value in figures.items()})


def describe(figures: dict[str, float]) -> str:
    """One line for messages: compute rate, per-collective cost, links."""
    parts = [f"{figures['flops_per_s'] / 1e9:,.1f} GFLOP/s per rank" if "flops_per_s" in figures else "",
             f"{figures['collective_overhead_s'] * 1e3:.2f} ms per collective" if "collective_overhead_s" in figures else "",
             _chunk(figures),
             f"inter-node {figures['inter_node_bandwidth'] * 8 / 1e6:,.0f} Mbit/s per node" if "inter_node_bandwidth" in figures else "",
             f"latency {figures['inter_node_latency_s'] * 1e3:.2f} ms" if figures.get("inter_node_latency_s") else ""]
    return ", ".join(p for p in parts if p)


def _chunk(figures: dict[str, float]) -> str:
    if "chunk_overhead_s" not in figures:
        return ""
    value = figures["chunk_overhead_s"]
    return f"{value * 1e3:.2f} ms per extra chunk" if value else "the device's typical cost per extra chunk (cost.moe.CHUNK_OVERHEAD_S)"
