"""hierarchical_a2a: send expert all-to-alls hierarchically across nodes, all or where it pays.

DeepEP's internode dispatch and Tutel's 2DH all-to-all: a row bound for several ranks of a
remote node crosses the inter-node link once, to one rank of that node, which forwards it
over the node's own links. The graph's computation does not change: the pass marks the
program, and the runtime's comm scheduler runs its all-to-alls with the hierarchical
algorithm (`commfx.runtime.hierarchical_a2a`), which returns the flat result bit for bit.
`enabled=auto` asks the cost model (`cost.all_to_all`) per MoE block's dispatch and combine
whether the rows it saves on the inter-node link pay for its two intra-node exchanges, and
names each block's all-to-alls so the runtime (and `commfx simulate`) run each with its
choice. Works with every MoE plan (expert_parallel, partition_a2a, pack_experts, locality_gate).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..compiler.program import Program
from ..cost.all_to_all import A2AShape, Links, choose_algorithm, duplicate_share, reach_share
from ..plan import Plan, PlanError, Topology
from .base import RuntimeSetting, plan_micro_batches, register
from .dispatch_codec import retag

commfx = torch.ops.commfx
PASS = "hierarchical_a2a"
ENABLED = {"true": "hierarchical", "1": "hierarchical", "yes": "hierarchical", "false": "flat", "0": "flat", "no": "flat", "auto": "auto"}
# passes whose all-to-alls auto must see as they run (chunks, packed rows): they come first
REBUILDERS = ("partition_a2a", "pack_experts")


def node_count(topology: Topology) -> int:
    """Nodes one expert-parallel group spans (1 when the plan has no nodes)."""
    ep = topology.expert_parallel_size
    return len({topology.node_of(r) for r in range(ep)})


def mode(options) -> str:
    """hierarchical | flat | auto, from `enabled` (true/false/auto, or a bool)."""
    try:
        return ENABLED[str(options.enabled).strip().lower()]
    except KeyError:
        raise PlanError(f"hierarchical_a2a enabled must be true, false or auto, got {options.enabled!r}") from None


@register(PASS, rewrites="moe_blocks", requires="expert parallel", setting="a2a_algorithm")
class HierarchicalA2A(RuntimeSetting):
    """All-to-all in two levels: once per remote node, then forwarded inside it (DeepEP, Tutel 2DH)."""

    @dataclasses.dataclass(frozen=True)
    class Options:
        # true: every all-to-all hierarchical; false: flat (one all_to_all_single); auto: the cost
        # model picks per MoE block's dispatch and combine (ties and unknowns: flat)
        enabled: str = "true"

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        chosen = mode(options)
        if chosen != "flat" and node_count(plan.topology) < 2:
            topology = plan.topology
            raise PlanError(
                f"hierarchical_a2a needs an expert-parallel group that spans nodes, but this plan has "
                f"{'no nodes (ranks_per_node is 0: every rank on one node)' if not topology.ranks_per_node else f'ep={topology.expert_parallel_size} ranks on one node of {topology.ranks_per_node}'}; "
                "set the ranks per node (--ranks-per-node, Topology(ranks_per_node=...)) below the expert-parallel size, "
                "or drop hierarchical_a2a"
            )
        names = plan.pass_names()
        if chosen == "auto":
            late = [n for n in REBUILDERS if n in names and names.index(n) > names.index(PASS)]
            if late:
                raise PlanError(
                    f"hierarchical_a2a:enabled=auto chooses from the all-to-alls as {late[0]} leaves them (chunks, packed rows), "
                    f"but {late[0]} comes after it; put hierarchical_a2a after {', '.join(late)}"
                )

    @classmethod
    def value(cls, options: Options) -> str:
        chosen = mode(options)
        return "flat" if chosen == "auto" else chosen

    @classmethod
    def evidence(cls, program: Program, options: Options) -> dict[str, int]:
        sites = program.runtime.a2a_sites
        if not sites:
            return super().evidence(program, options)
        counts: dict[str, int] = {}
        for algorithm in sites.values():
            counts[f"a2a_sites: {algorithm}"] = counts.get(f"a2a_sites: {algorithm}", 0) + 1
        return counts

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        chosen = mode(options)
        sites = [(block, role, node, forward) for block in program.regions.moe_blocks for role, node, forward in _sites(block, program, plan)]
        keys, named = {}, False
        for block, role, node, _ in sites:
            keys[block.path, role] = key = f"{block.path} {'packed ' if block.packed is not None else ''}{role}"
            if chosen != "flat" and node is not None and not _tag(node):  # expert_parallel leaves its all-to-alls untagged:
                retag(node, _priority(node), key)  # named, the runtime and `commfx simulate` tell dispatch from combine
                named = True
        if named:
            program.gm.recompile()
        if chosen != "auto":
            return super().run(program, options, plan) or named
        program.runtime.a2a_algorithm = "flat"  # count exchanges and other all-to-alls
        decisions = program.decisions.setdefault(PASS, {})
        lines = []
        links = Links.of(plan.topology)
        for block, role, _, forward in sites:
            key = keys[block.path, role]
            choice = choose_algorithm(forward, links) if forward is not None else None
            algorithm = program.runtime.a2a_sites[key] = choice.algorithm if choice is not None else "flat"
            if choice is None:
                decisions[key] = {"algorithm": algorithm, "why": "tokens per rank unknown"}
                lines.append(f"{key} flat (tokens per rank unknown)")
                continue
            decisions[key] = {"algorithm": algorithm, "flat_s": choice.flat_s, "hierarchical_s": choice.hierarchical_s,
                              "duplicate_share": choice.duplicate_share, "rows": forward.rows, "row_bytes": forward.row_bytes}
            lines.append(f"{key} {algorithm} ({choice.flat_s * 1e3:.3g} ms flat, {choice.hierarchical_s * 1e3:.3g} ms hierarchical, "
                         f"fw+bw; {choice.duplicate_share:.0%} of off-node rows repeat)")
        program.notes.append(f"{PASS}: enabled=auto, the cost model's choice per all-to-all from the topology's figures: " + "; ".join(lines))
        return named


def _sites(block, program: Program, plan: Plan):
    """(role, the node to name when it has no tag or None, the forward all-to-all's shape or None)
    for the dispatch and the combine of `block` as the passes before left it."""
    topology = plan.topology
    ep, per_node = topology.expert_parallel_size, min(topology.node_size, topology.expert_parallel_size)
    tokens = program.tokens_per_rank
    ex = block.exchange
    nodes = {"dispatch": ex.received, "combine": ex.returned} if ex is not None else {"dispatch": None, "combine": None}
    if tokens is None:
        return [(role, nodes[role], None) for role in ("dispatch", "combine")]
    down = program.gm.get_parameter(block.down)
    hidden, dtype_bytes = down.shape[1], (2 if plan.precision == "bf16" else down.element_size())
    per_chunk = max(1, tokens // plan_micro_batches(plan)) / max(1, block.chunks)
    if block.packed is not None:  # one row per (token, rank), with its own routing weights and ids: nothing repeats
        rows, duplicates = per_chunk * ep * reach_share(block.num_experts, block.top_k, ep), 0.0
    else:
        rows, duplicates = per_chunk * block.top_k, duplicate_share(block.num_experts, block.top_k, node_count(topology))
    dispatch_bytes = hidden + 4 * math.ceil(hidden / 128) if block.dispatch_codec == "fp8" else hidden * dtype_bytes
    return [
        ("dispatch", nodes["dispatch"], A2AShape(rows, dispatch_bytes, ep, per_node, duplicates)),
        ("combine", nodes["combine"], A2AShape(rows, hidden * dtype_bytes, ep, per_node, 0.0)),
    ]


def _wire(node):
    """The all-to-all node itself (under fp8 the decode reads it)."""
    return node.args[0] if node.target is commfx.fp8_decode.default else node


def _tag(node) -> str:
    args = _wire(node).args
    return args[5] if len(args) > 5 else ""


def _priority(node) -> str:
    args = _wire(node).args
    return args[4] if len(args) > 4 else "a2a"
