"""How tensor_parallel finds a block: a module whose linears are column-parallel ones
reading the block's input and one row-parallel linear producing its output, and whose ops
in between keep the split dimension apart (`compiler.shard_propagation`). `plan_block` returns the
`Block`: its linears, their layouts, where the replicated input enters, and the literal
sizes to make local; the tensor_parallel pass rewrites it, and `tp_units` plans it again
one unit at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.program import module_paths
from ..compiler.shard_propagation import ELEMENTWISE, SHARD_RULES, RuleContext, Shard, Sizes, Unsupported, dim_arg, ndim_of, needs_grad, op_name, shape_of


@dataclass
class Block:
    path: str
    columns: list[fx.Node]
    row: fx.Node
    layouts: dict[fx.Node, tuple[int, int, int]]  # column linear -> its output layout
    row_layout: tuple[int, int, int]
    copies: dict[fx.Node, list[fx.Node]]  # replicated value needing tp_copy -> consumers in the block
    rewrites: list[tuple[fx.Node, tuple, dict]]  # node -> new args/kwargs (literal sizes made local)
    split: tuple[fx.Node, ...] = ()  # the values cut over tp, the column linears' outputs onwards


class NotABlock(Exception):
    pass


def uncast(node):
    """The value under the casts `Plan(precision=...)` wrote into the graph (a linear under bf16
    reads a bf16 cast of its input and of its weight); any other value as it is."""
    while isinstance(node, fx.Node) and (node.meta.get("commfx") or {}).get("pass") == "precision" and op_name(node) == "to":
        node = node.args[0]
    return node


def is_linear(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (F.linear, torch._C._nn.linear):
        return False
    weight = uncast(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
    return isinstance(weight, fx.Node) and weight.op == "get_attr" and ndim_of(weight) == 2


def regions_innermost_first(graph: fx.Graph) -> list[tuple[str, list[fx.Node]]]:
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue  # inputs and parameters enter a region from outside
        for path, _cls in module_paths(node):
            regions.setdefault(path, []).append(node)
    return sorted(regions.items(), key=lambda item: -item[0].count(".") if item[0] else 1)


def plan_block(graph: fx.Graph, path: str, nodes: list[fx.Node], linears: list[fx.Node], tp: int, sizes: "Sizes") -> Block:
    region = set(nodes)
    columns = [n for n in linears if uncast(n.args[0]) not in region]
    rows = [n for n in linears if n not in columns]
    if not rows or not columns:
        raise NotABlock
    if len(rows) > 1:
        raise Unsupported(
            f"no single output linear: {', '.join(n.name for n in rows)} all read values computed inside it "
            "(e.g. latent attention's down- and up-projections)"
        )
    row = rows[0]
    if len({uncast(c.args[0]) for c in columns}) != 1:
        raise Unsupported("its column linears read different inputs")
    for linear in linears:
        weight = uncast(linear.args[1])
        if len(weight.users) != 1 or sum(1 for n in graph.nodes if n.op == "get_attr" and n.target == weight.target) != 1:
            raise Unsupported(f"weight {weight.target} is used elsewhere too (tied)")
    shards: dict[fx.Node, object] = {}
    layouts = {}
    for column in columns:
        layouts[column] = _column_layout(column, region, sizes)
        _check_units(layouts[column], tp, column)
        shards[column] = Shard(-1, layouts[column])
    # the replicated input enters through one tp_copy, ahead of each column's cast of it (if any)
    copies: dict[fx.Node, list[fx.Node]] = {uncast(columns[0].args[0]): [_entry(c) for c in columns]}
    rewrites: list[tuple[fx.Node, tuple, dict]] = []
    row_layout = None
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted((n for n in graph.nodes if order[n] > min(order[c] for c in columns)), key=order.get):
        if node in shards or not any(a in shards for a in node.all_input_nodes):
            continue
        if node is row:
            entering = shards.get(row.args[0])
            if not isinstance(entering, Shard) or entering.dim != -1:
                raise Unsupported(f"the output linear {row.name} does not contract over the split dimension")
            row_layout = entering.layout
            _check_units(row_layout, tp, row)
            continue
        if node not in region:
            raise Unsupported(f"{node.name} ({op_name(node)}) outside the block uses the split value {node.all_input_nodes[0].name}")
        if is_linear(node):
            raise Unsupported(f"linear {node.name} reads a split value and is not the block's output linear")
        rule = SHARD_RULES.get(op_name(node))
        if rule is None:
            raise Unsupported(f"no rule for {op_name(node)} (node {node.name}) on a split value")
        result = rule(RuleContext(node, shards, sizes, tp, rewrites))
        if result is not None:
            shards[node] = result
        for arg in node.all_input_nodes:
            if arg not in shards and needs_grad(arg):
                copies.setdefault(arg, []).append(node)
    if row_layout is None:
        raise Unsupported(f"the split values never reach the output linear {row.name}")
    split = tuple(n for n, shard in shards.items() if isinstance(shard, Shard))
    return Block(path, columns, row, layouts, row_layout, copies, rewrites, split)


def _entry(column: fx.Node) -> fx.Node:
    """The node that reads the block's input for `column`: its precision cast, or itself."""
    node = column
    while node.args[0] is not uncast(node.args[0]):
        node = node.args[0]
    return node


def _check_units(layout, tp, node):
    if layout[1] % tp:
        raise Unsupported(f"{node.name} has {layout[1]} heads/columns, which tp={tp} does not divide")


def _column_layout(column: fx.Node, region: set[fx.Node], sizes: "Sizes") -> tuple[int, int, int]:
    """How the column output's last dim is cut: found at the first op that splits it
    downstream (a view into heads x head_dim, a chunk of a fused gate/up), else columns."""
    n = sizes.of(shape_of(column)[-1])
    frontier = [column]
    seen = set()
    while frontier:
        node = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            name = op_name(user)
            if user not in region:
                continue
            if name in ("view", "reshape") and shape_of(user) is not None:
                out = [sizes.of(s) for s in shape_of(user)]
                group, product = [], 1
                for size in reversed(out):
                    if product >= n:
                        break
                    group.insert(0, size)
                    product *= size
                if product == n and len(group) >= 2 and n % (group[-1] * group[-2]) == 0:
                    return (n // (group[-1] * group[-2]), group[-2], group[-1])
                return (1, n, 1)
            if name in ("chunk", "split") and dim_arg(user, 2, default=0, ndim=len(shape_of(node))) == len(shape_of(node)) - 1:
                pieces = user.args[1] if name == "chunk" else n // user.args[1]
                return (pieces, n // pieces, 1)
            if name in ELEMENTWISE:
                frontier.append(user)
    return (1, n, 1)


def bias_of(linear: fx.Node):
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
