"""hierarchical_a2a: send every expert all-to-all hierarchically across nodes.

DeepEP's internode dispatch and Tutel's 2DH all-to-all: a row bound for several ranks of a
remote node crosses the inter-node link once, to one rank of that node, which forwards it
over the node's own links. The graph does not change: the pass marks the program, and the
runtime's comm scheduler runs its all-to-alls with the hierarchical algorithm
(`commfx.runtime.hierarchical_a2a`), which returns the flat result bit for bit. Works
with every MoE plan (expert_parallel, partition_a2a, pack_experts, locality_gate).
"""

from __future__ import annotations

import dataclasses

from ..plan import Plan, PlanError, Topology
from .base import RuntimeSetting, register

PASS = "hierarchical_a2a"


def node_count(topology: Topology) -> int:
    """Nodes one expert-parallel group spans (1 when the plan has no nodes)."""
    ep = topology.expert_parallel_size
    return len({topology.node_of(r) for r in range(ep)})


@register(PASS, rewrites="moe_blocks", requires="expert parallel", setting="a2a_algorithm")
class HierarchicalA2A(RuntimeSetting):
    """All-to-all in two levels: once per remote node, then forwarded inside it (DeepEP, Tutel 2DH)."""

    @dataclasses.dataclass(frozen=True)
    class Options:
        enabled: bool = True  # false: the flat all-to-all (one all_to_all_single)

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.enabled and node_count(plan.topology) < 2:
            topology = plan.topology
            raise PlanError(
                f"hierarchical_a2a needs an expert-parallel group that spans nodes, but this plan has "
                f"{'no nodes (ranks_per_node is 0: every rank on one node)' if not topology.ranks_per_node else f'ep={topology.expert_parallel_size} ranks on one node of {topology.ranks_per_node}'}; "
                "set the ranks per node (--ranks-per-node, Topology(ranks_per_node=...)) below the expert-parallel size, "
                "or drop hierarchical_a2a"
            )

    @classmethod
    def value(cls, options: Options) -> str:
        return "hierarchical" if options.enabled else "flat"
