"""Communicating work first: a backward schedule that starts gradient all-reduces early.

aot_autograd orders a backward graph by the forward's reverse, so work that nothing on the
wire waits for (a vocabulary-parallel head's weight gradient, an expert's weight gradient
at ep = world, whose groups have one rank) can run before the layers whose gradients the
all-reduce carries. Moving it after them starts the all-reduce sooner and lets it run
under that work instead. The function is unchanged: only the order of independent nodes.
"""

from __future__ import annotations

import torch.fx as fx

from .executor import is_collective

_FIXED = {"placeholder", "output", "get_attr"}


def communicating_first(gm: fx.GraphModule, urgent: set[fx.Node]) -> int:
    """Reorder `gm` in place so that every node an `urgent` node (a gradient a communicating
    bucket carries) or a collective depends on runs before every node none of them does;
    each group keeps its order. Returns how many nodes moved.

    A node's consumers depend on whatever it depends on, so a node that nothing urgent
    needs has consumers that nothing urgent needs either: moving the second group after
    the first keeps the graph topologically ordered."""
    needed: set[fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n in urgent or is_collective(n)]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    nodes = list(gm.graph.nodes)
    last_needed = max((i for i, n in enumerate(nodes) if n in needed), default=-1)
    later = [n for n in nodes[: last_needed + 1] if n.op not in _FIXED and n not in needed]
    if not later:
        return 0
    anchor = nodes[last_needed]
    for node in reversed(later):
        anchor.append(node)
    gm.graph.lint()
    gm.recompile()
    return len(later)


__all__ = ["communicating_first"]
