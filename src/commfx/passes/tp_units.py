"""Unit functions: each tensor-parallel block computed for a few of its units alone.

resize_tp moves whole units of a block (attention heads, kv groups, or blocks of MLP
columns) from a slow rank to a faster one, which computes them end to end from the block's
replicated input. The function it runs is planned here, on the graph before the
tensor_parallel pass rewrites it, with the same shard rules as the block itself.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.rewrite import Rewriter
from .tp_blocks import Block, NotABlock, bias_of, plan_block
from ..compiler.shard_propagation import Sizes, Unsupported


UNIT_BLOCKS = 8  # an MLP's unit: its intermediate columns on one rank in about this many blocks


def _unit_size(per: int, heads: bool) -> int:
    """Heads or columns in one unit: a head; for an MLP the fewest columns that cut one
    rank's share into at most UNIT_BLOCKS equal blocks."""
    if heads:
        return 1
    return next(g for g in range(1, per + 1) if per % g == 0 and per // g <= UNIT_BLOCKS)


def unit_function(graph: fx.Graph, block: Block, nodes, linears, tp: int, sizes: "Sizes") -> dict | None:
    """The block computed for a few consecutive parts alone, as its own graph: (count, the
    block's outside inputs..., each column linear's weight rows [and bias], the row linear's
    weight columns) -> their row-parallel partial product (no bias), for any `count` parts
    whose weight slices are given (cut as each weight's layout, outer x count x inner).

    A part is the finest cut every linear of the block shares: a head, a kv group (the q
    heads that share one k/v head under grouped-query attention), or one MLP column. Planned
    with the same shard rules as the block, one part per rank; the literal sizes those rules
    make local become count x the per-part size, so one graph serves any count. None where
    the rules cannot cut the block that finely. `unit` (in parts) is what resize_tp moves at
    a time: a head or kv group, or the fewest columns that cut one rank's share into at most
    UNIT_BLOCKS blocks; `per_rank` is parts per rank. A faster rank computes a slower rank's
    units with it from the replicated input (runtime/resize/units.py)."""
    inner = block.row_layout[2]
    # the finest cut every linear of the block shares: a head (a kv group under grouped-query
    # attention, whose k/v have fewer heads than q), or one MLP column
    parts = math.gcd(block.row_layout[1], *(layout[1] for layout in block.layouts.values()))
    per = parts // tp
    try:
        planned = plan_block(graph, block.path, nodes, linears, parts, sizes)
    except (Unsupported, NotABlock):
        return None
    new_args = {node: (args, kwargs) for node, args, kwargs in planned.rewrites}
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside, sequence = set(block.columns), []
    for node in sorted((n for n in graph.nodes if min(order[c] for c in block.columns) <= order[n] <= order[block.row]), key=order.get):
        if node in inside or any(a in inside for a in node.all_input_nodes):
            inside.add(node)
            sequence.append(node)
    weights = {c.args[1] for c in [*block.columns, block.row]} | {bias_of(c) for c in block.columns if isinstance(bias_of(c), fx.Node)}
    externals = []
    for node in sequence:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in weights and arg not in externals and not (node is block.row and arg is bias_of(node)):
                externals.append(arg)
    sub = fx.Graph()
    rw = Rewriter(sub, "tensor_parallel")  # a graph of its own: no module stacks, no stamps
    placeholder = lambda name: rw.call(name, op="placeholder")  # noqa: E731
    count = placeholder("count")
    env = {e: placeholder(f"input_{i}") for i, e in enumerate(externals)}
    columns = []
    for i, column in enumerate(block.columns):
        bias = bias_of(column)
        env[column.args[1]] = placeholder(f"weight_{i}")
        if isinstance(bias, fx.Node):
            env[bias] = placeholder(f"bias_{i}")
        columns.append({"weight": column.args[1].target, "bias": bias.target if isinstance(bias, fx.Node) else None,
                        "layout": [block.layouts[column][0], block.layouts[column][1] // tp, block.layouts[column][2]]})
    env[block.row.args[1]] = placeholder("row_weight")

    def scaled(old, new):
        """`new` with each literal the rules divided (old != new) as count x new."""
        if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
            return type(new)(scaled(o, n) for o, n in zip(old, new))
        if type(old) is int and type(new) is int and old != new:
            return new if new == -1 else rw.call(operator.mul, (count, new))
        return fx.map_arg(new, env.get)

    for node in sequence:
        if node in block.columns or node is block.row:
            args = (env[node.args[0]], env[node.args[1]], env.get(bias_of(node)) if node in block.columns else None)
            env[node] = rw.call(F.linear, args)
        elif node in new_args:
            args, kwargs = new_args[node]
            env[node] = rw.call(node.target, scaled(node.args, args), scaled(node.kwargs, kwargs), op=node.op)
        else:
            env[node] = rw.copy(node, fx.map_arg(node.args, env.__getitem__), fx.map_arg(node.kwargs, env.__getitem__), name=node.name)
    rw.call("output", (env[block.row],), op="output")
    return {
        "graph": fx.GraphModule(torch.nn.Module(), sub), "externals": externals, "columns": columns,
        "row": {"weight": block.row.args[1].target, "layout": [block.row_layout[0], block.row_layout[1] // tp, block.row_layout[2]]},
        "unit": _unit_size(per, heads=inner > 1), "per_rank": per,
    }
