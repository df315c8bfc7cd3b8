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

from ..compiler.program import Program
from ..plan import Plan, PlanError, Topology
from .base import Pass, register

PASS = "hierarchical_a2a"


def node_count(topology: Topology) -> int:
    """Nodes one expert-parallel group spans (1 when the plan has no nodes)."""
    ep = topology.expert_parallel_size
    return len({topology.node_of(r) for r in range(ep)})


@register
class HierarchicalA2A(Pass):
    """All-to-all in two levels: once per remote node, then forwarded inside it (DeepEP, Tutel 2DH)."""

    name = PASS
    requires = ("expert parallel",)

    @dataclasses.dataclass(frozen=True)
    class Options:
        enabled: bool = True  # false: the flat all-to-all (one all_to_all_single)

    @classmethod
    def applies(cls, program: Program) -> bool:
        return bool(program.regions.moe_blocks)

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
    def evidence(cls, program: Program, options: Options) -> dict[str, int]:
        return {f"{program.runtime.a2a_algorithm} all-to-all": 1}

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        program.runtime.a2a_algorithm = "hierarchical" if options.enabled else "flat"
        return False
