"""The checks every pass's output must pass: a well-formed graph and the SPMD invariants
(no rank queried inside the graph, every collective on a known group and priority class,
every split-phase collective waited on)."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..plan import DEFAULT_CLASS, PRIORITY_CLASSES, Plan
from .program import PassError, Program


GROUPED_OPS = ("all_to_all", "exchange_counts", "all_reduce", "tp_copy")  # commfx collectives naming their group
RANK_QUERIES = {"get_rank", "get_world_size", "get_process_group_ranks"}


def verify_graph(program: Program, plan: Plan) -> None:
    """Lint the graph and check the SPMD invariants every pass must keep."""
    graph = program.graph
    graph.lint()
    known_groups = set(plan.topology.process_groups())
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target_name = getattr(node.target, "__name__", str(node.target))
        if target_name in RANK_QUERIES or "get_rank" in str(node.target):
            raise PassError(f"node {node.name} queries the rank inside the graph; rank-dependent values must be runtime inputs")
        if _is_commfx(node, GROUPED_OPS):
            group = node.args[3] if node.target is torch.ops.commfx.all_to_all.default else node.args[1]
            if group not in known_groups:
                raise PassError(f"node {node.name} uses process group {group!r}, which the plan does not define")
            priority_at = {torch.ops.commfx.all_to_all.default: 4, torch.ops.commfx.exchange_counts.default: 3}.get(node.target)
            has_arg = priority_at is not None and len(node.args) > priority_at
            priority = node.args[priority_at] if has_arg else node.kwargs.get("priority", DEFAULT_CLASS)
            if priority not in PRIORITY_CLASSES:
                raise PassError(f"node {node.name} uses priority class {priority!r}, which is not registered")
    verify_waits(graph)


def verify_waits(graph: fx.Graph) -> None:
    """Every split-phase collective (c10d functional or commfx start) has a matching wait."""
    for node in graph.nodes:
        target = str(node.target)
        started = ("_c10d_functional" in target and "wait_tensor" not in target) or node.target is torch.ops.commfx.all_to_all_start.default
        if started and not any("wait_tensor" in str(user.target) for user in node.users):
            raise PassError(f"collective {node.name} has no matching wait_tensor")


def _is_commfx(node: fx.Node, names: tuple[str, ...]) -> bool:
    return any(node.target is getattr(torch.ops.commfx, n).default for n in names)
