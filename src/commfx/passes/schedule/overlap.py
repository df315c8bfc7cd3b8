"""overlap_collectives: the schedule pass on lowered forward and backward graphs.

Every `commfx.all_to_all` becomes `all_to_all_start` + `wait_tensor`. Starts move as early
as their inputs allow and waits as late as their first use, so the compute between them
(for a partitioned MoE region: the neighbouring chunks' experts) runs while the rows are
on the wire. Starts keep their relative graph order: that order is the submission order
the comm scheduler's FIFO lanes see, the same on every rank. The function is unchanged:
only when the runtime blocks moves.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ... import ops  # noqa: F401  (registers torch.ops.commfx)
from ...compiler.rewrite import Rewriter
from ...compiler.graph_checks import verify_waits

commfx = torch.ops.commfx


def overlap_collectives(gm: fx.GraphModule) -> int:
    """Split and reschedule the all-to-alls of `gm` in place; returns how many were split."""
    graph = gm.graph
    rw = Rewriter(graph, "overlap_collectives")
    starts: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is commfx.all_to_all.default:
            starts.append(_split(rw, node))
    if not starts:
        return 0
    _hoist_starts(graph, starts)
    for start in starts:
        _sink_wait(next(iter(start.users)))
    graph.lint()
    verify_waits(graph)
    gm.recompile()
    return len(starts)


def _split(rw: Rewriter, node: fx.Node) -> fx.Node:
    x, send_counts, recv_counts, group, *rest = node.args
    priority = rest[0] if len(rest) > 0 else node.kwargs.get("priority", "a2a")
    tag = rest[1] if len(rest) > 1 else node.kwargs.get("tag", "")
    keep = ("val", "stack_trace", "seq_nr")
    with rw.before(node):
        start = rw.call(commfx.all_to_all_start.default, (x, send_counts, recv_counts, group, priority, tag), like=node, keep=keep)
        wait = rw.call(commfx.wait_tensor.default, (start,), like=node, keep=keep)
    rw.replace(node, wait)
    return start


def _hoist_starts(graph: fx.Graph, starts: list[fx.Node]) -> None:
    """Move each start right after its last input (and after the previous start)."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    previous: fx.Node | None = None
    for start in starts:
        anchors = [n for n in start.all_input_nodes] + ([previous] if previous is not None else [])
        anchor = max(anchors, key=lambda n: position[n]) if anchors else None
        if anchor is not None and position[anchor] < position[start] - 1:
            anchor.append(start)  # fx: moves `start` to just after `anchor`
            position = {node: i for i, node in enumerate(graph.nodes)}
        previous = start


def _sink_wait(wait: fx.Node) -> None:
    """Move a wait to just before its first user."""
    if not wait.users:
        return
    order = {node: i for i, node in enumerate(wait.graph.nodes)}
    first_user = min(wait.users, key=lambda n: order[n])
    if order[first_user] > order[wait] + 1:
        first_user.prepend(wait)
