"""tensor_parallel: Megatron column/row parallel attention and MLP blocks.

A block is a module whose linears are column-parallel ones reading the block's input and one
row-parallel linear producing its output (attention: q/k/v or a fused qkv, then o_proj; an
MLP: gate/up, then down). Each rank computes its own heads or intermediate columns
(Shoeybi et al., Megatron-LM, 2019): the column weights are split by rows, the row weight
by columns, `commfx.tp_copy` marks where the replicated input enters (its gradient is
summed over `tp` in backward) and `commfx.all_reduce` sums the row linear's partial
products (bias added after). Experts stay with expert_parallel; embeddings and the LM head
stay replicated.

Between the two, every op must keep the sharded dimension apart, so the pass follows it
node by node (`SHARD_RULES`: elementwise ops, views, transposes, indexing, attention, ...)
and rewrites the literal sizes it meets (`view(b, s, 3, 4, 8)` -> `view(b, s, 3, 2, 8)` at
tp=2). How a dimension is cut is a layout (outer, units, inner): units are heads (inner =
head dim) or columns, and a fused q/k/v has outer 3. A block the rules do not cover stays
replicated and is named in a warning (or an error with `strict=true`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import ops  # noqa: F401  (registers torch.ops.commfx)
from ..compiler.program import Program, module_paths, stamp
from ..ops.tp import shard_index
from ..plan import Plan, PlanError, divisors
from .base import Pass, PassError, register

commfx = torch.ops.commfx
PASS = "tensor_parallel"
GROUP = "tp"


class Unsupported(Exception):
    """This block cannot be split (the message says which node and why)."""


@dataclass(frozen=True)
class Shard:
    """A value cut along `dim` (negative: counted from the last dim) by `layout`."""

    dim: int
    layout: tuple[int, int, int]  # (outer, units, inner), row-major numbering of the dim


@dataclass
class Block:
    path: str
    columns: list[fx.Node]
    row: fx.Node
    layouts: dict[fx.Node, tuple[int, int, int]]  # column linear -> its output layout
    row_layout: tuple[int, int, int]
    copies: dict[fx.Node, list[fx.Node]]  # replicated value needing tp_copy -> consumers in the block
    rewrites: list[tuple[fx.Node, tuple, dict]]  # node -> new args/kwargs (literal sizes made local)


@register
class TensorParallel(Pass):
    """Megatron column/row parallel attention (heads) and MLPs (columns) over the `tp` group.

    (Shoeybi et al. 2019, Megatron-LM; the substrate ZERO-resizing and migration resize.)
    """

    name = PASS
    ensures = ("tensor parallel",)

    @dataclasses.dataclass(frozen=True)
    class Options:
        strict: bool = False  # a block that cannot be split is an error instead of a warning

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        tp = plan.topology.tp
        if model is None or tp == 1:
            return
        for where, name, value in _head_counts(model):
            if value % tp:
                raise PlanError(
                    f"{where} has {name}={value}, which tensor-parallel size {tp} does not divide; choose --tp from "
                    f"{[d for d in divisors(value) if plan.topology.world_size % d == 0]}"
                )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        tp = plan.topology.tp
        graph = program.graph
        sizes = _Sizes()
        claimed: set[fx.Node] = set()
        blocks, skipped, members = [], [], {}
        unsplittable: set[fx.Node] = set()  # linears of a block already reported: enclosing modules leave them out
        for path, nodes in _regions_innermost_first(graph):
            linears = [n for n in nodes if _is_linear(n) and n not in claimed and n not in unsplittable]
            try:
                block = _plan_block(graph, path, nodes, linears, tp, sizes)
            except _NotABlock:
                continue
            except Unsupported as why:
                unsplittable.update(linears)
                skipped.append(f"{path}: {why}")
                continue
            claimed.update(block.columns + [block.row])
            blocks.append(block)
            members[block.path] = (nodes, linears)
        if skipped and options.strict:
            raise PassError("tensor_parallel cannot split these blocks: " + "; ".join(skipped))
        if skipped:
            warnings.warn(
                "tensor_parallel leaves these blocks replicated (their ops keep no sharded dimension apart): "
                + "; ".join(skipped),
                stacklevel=2,
            )
        if not blocks:
            raise PassError(
                "tensor_parallel found no attention or MLP block to split (a module whose linears read its input "
                "and feed one output linear)" + (f"; blocks it could not split: {'; '.join(skipped)}" if skipped else "")
            )
        shards = program.annotations.setdefault("shards", {})
        # Each block's unit function, planned on the graph before any block is rewritten.
        units = {b.path: _unit_function(graph, b, *members[b.path], tp, sizes) for b in blocks}
        for block in blocks:
            copies = _rewrite_block(graph, block, tp, shards)
            if units[block.path] is not None:  # the unit function reads the tp_copy where one was made
                units[block.path]["externals"] = [copies.get(e, e).name for e in units[block.path]["externals"]]
        program.annotations["tp_units"] = {path: u for path, u in units.items() if u is not None}
        program.annotations["tp_blocks"] = [
            {"path": b.path, "columns": [c.name for c in b.columns], "row": b.row.name, "units": b.row_layout[1]} for b in blocks
        ]
        program.annotations["tp_skipped"] = skipped
        program.annotations.setdefault("notes", []).append(_note(blocks, skipped, tp))
        program.gm.recompile()
        return True


def _note(blocks: list["Block"], skipped: list[str], tp: int) -> str:
    """What the pass split and what it left replicated, for `commfx dump`."""
    split = ", ".join(f"{b.path} ({b.row_layout[1]} units)" for b in blocks)
    note = f"tensor_parallel splits {len(blocks)} block(s) over tp={tp}: {split}"
    if skipped:
        note += f"; leaves {len(skipped)} replicated (tensor_parallel:strict=true makes this an error): " + "; ".join(skipped)
    return note


def _head_counts(model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(where, attribute, value) of every attention head count the model declares."""
    found = []
    names = ("num_heads", "num_attention_heads", "num_key_value_heads")
    for path, module in model.named_modules():
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and value > 0:
                found.append((path or type(module).__name__, name, value))
        config = getattr(module, "config", None)
        if path == "" and config is not None:
            for name in names:
                value = getattr(config, name, None)
                if isinstance(value, int) and value > 0:
                    found.append((f"{type(model).__name__}.config", name, value))
    return found


# ------------------------------------------------------------------------ finding blocks


class _NotABlock(Exception):
    pass


def _is_linear(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (F.linear, torch._C._nn.linear):
        return False
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    return isinstance(weight, fx.Node) and weight.op == "get_attr" and _shape_len(weight) == 2


def _regions_innermost_first(graph: fx.Graph) -> list[tuple[str, list[fx.Node]]]:
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue  # inputs and parameters enter a region from outside
        for path, _cls in module_paths(node):
            regions.setdefault(path, []).append(node)
    return sorted(regions.items(), key=lambda item: -item[0].count(".") if item[0] else 1)


def _plan_block(graph: fx.Graph, path: str, nodes: list[fx.Node], linears: list[fx.Node], tp: int, sizes: "_Sizes") -> Block:
    region = set(nodes)
    columns = [n for n in linears if n.args[0] not in region]
    rows = [n for n in linears if n not in columns]
    if not rows or not columns:
        raise _NotABlock
    if len(rows) > 1:
        raise Unsupported(
            f"no single output linear: {', '.join(n.name for n in rows)} all read values computed inside it "
            "(e.g. latent attention's down- and up-projections)"
        )
    row = rows[0]
    if len({c.args[0] for c in columns}) != 1:
        raise Unsupported("its column linears read different inputs")
    for linear in linears:
        weight = linear.args[1]
        if len(weight.users) != 1 or sum(1 for n in graph.nodes if n.op == "get_attr" and n.target == weight.target) != 1:
            raise Unsupported(f"weight {weight.target} is used elsewhere too (tied)")
    shards: dict[fx.Node, object] = {}
    layouts = {}
    for column in columns:
        layouts[column] = _column_layout(column, region, sizes)
        _check_units(layouts[column], tp, column)
        shards[column] = Shard(-1, layouts[column])
    copies: dict[fx.Node, list[fx.Node]] = {columns[0].args[0]: list(columns)}
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
            raise Unsupported(f"{node.name} ({_op_name(node)}) outside the block uses the split value {node.all_input_nodes[0].name}")
        if _is_linear(node):
            raise Unsupported(f"linear {node.name} reads a split value and is not the block's output linear")
        rule = SHARD_RULES.get(_op_name(node))
        if rule is None:
            raise Unsupported(f"no rule for {_op_name(node)} (node {node.name}) on a split value")
        result = rule(_Ctx(node, shards, sizes, tp, rewrites))
        if result is not None:
            shards[node] = result
        for arg in node.all_input_nodes:
            if arg not in shards and _needs_grad(arg):
                copies.setdefault(arg, []).append(node)
    if row_layout is None:
        raise Unsupported(f"the split values never reach the output linear {row.name}")
    return Block(path, columns, row, layouts, row_layout, copies, rewrites)


def _check_units(layout, tp, node):
    if layout[1] % tp:
        raise Unsupported(f"{node.name} has {layout[1]} heads/columns, which tp={tp} does not divide")


def _column_layout(column: fx.Node, region: set[fx.Node], sizes: "_Sizes") -> tuple[int, int, int]:
    """How the column output's last dim is cut: found at the first op that splits it
    downstream (a view into heads x head_dim, a chunk of a fused gate/up), else columns."""
    n = sizes.of(_shape(column)[-1])
    frontier = [column]
    seen = set()
    while frontier:
        node = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            name = _op_name(user)
            if user not in region:
                continue
            if name in ("view", "reshape") and _shape(user) is not None:
                out = [sizes.of(s) for s in _shape(user)]
                group, product = [], 1
                for size in reversed(out):
                    if product >= n:
                        break
                    group.insert(0, size)
                    product *= size
                if product == n and len(group) >= 2 and n % (group[-1] * group[-2]) == 0:
                    return (n // (group[-1] * group[-2]), group[-2], group[-1])
                return (1, n, 1)
            if name in ("chunk", "split") and _dim_arg(user, 2, default=0, ndim=len(_shape(node))) == len(_shape(node)) - 1:
                pieces = user.args[1] if name == "chunk" else n // user.args[1]
                return (pieces, n // pieces, 1)
            if name in ELEMENTWISE:
                frontier.append(user)
    return (1, n, 1)


# -------------------------------------------------------------------------- shard rules


class _Ctx:
    """What a rule sees: the node, the shards of its inputs, concrete sizes, tp; `rewrite`
    records new arguments for the node (a literal size made local)."""

    def __init__(self, node, shards, sizes, tp, rewrites):
        self.node, self.shards, self.sizes, self.tp, self._rewrites = node, shards, sizes, tp, rewrites

    def shard(self, value) -> Shard | None:
        return self.shards.get(value) if isinstance(value, fx.Node) else None

    def the_shard(self, value) -> Shard:
        shard = self.shard(value)
        if not isinstance(shard, Shard):
            raise Unsupported(f"{self.node.name} ({_op_name(self.node)}) needs {getattr(value, 'name', value)} split")
        return shard

    def ndim(self, value) -> int:
        return _shape_len(value)

    def shape(self, value) -> list[int]:
        return [self.sizes.of(s) for s in _shape(value)]

    def rewrite(self, args, kwargs=None):
        self._rewrites.append((self.node, tuple(args), dict(self.node.kwargs if kwargs is None else kwargs)))

    def fail(self, why: str):
        raise Unsupported(f"{self.node.name} ({_op_name(self.node)}): {why}")


def _same(a: Shard, b: Shard, sizes_a: list[int], sizes_b: list[int], tp: int) -> bool:
    """Whether two shards cut equal-sized dims into the same index sets on every rank."""
    if a.dim != b.dim or sizes_a[a.dim] != sizes_b[b.dim]:
        return False
    return all(torch.equal(shard_index(a.layout, r, tp), shard_index(b.layout, r, tp)) for r in range(tp))


def _elementwise(ctx: _Ctx) -> Shard:
    node = ctx.node
    tensors = [node.args[0]] if _op_name(node) in ("to", "type_as", "float", "double", "half", "bfloat16") else [
        a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and _shape(a) is not None
    ]
    split = [t for t in tensors if isinstance(ctx.shard(t), Shard)]
    first = ctx.the_shard(split[0])
    for other in split[1:]:
        if not _same(first, ctx.shard(other), ctx.shape(split[0]), ctx.shape(other), ctx.tp):
            ctx.fail(f"{split[0].name} and {other.name} are split differently")
    for t in tensors:
        if t in split:
            continue
        shape = ctx.shape(t)
        if len(shape) >= -first.dim and shape[first.dim] != 1:
            ctx.fail(f"replicated {t.name} spans the split dimension (size {shape[first.dim]})")
    return first


def _reduction(ctx: _Ctx) -> Shard:
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or isinstance(dims, fx.Node):
        ctx.fail("reduces over every dimension")
    dims = [d - ndim if d >= 0 else d for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if shard.dim in dims:
        ctx.fail("reduces over the split dimension")
    keep = _op_name(node) in ("softmax", "log_softmax") or (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if keep:
        return shard
    return Shard(shard.dim + sum(1 for d in dims if d > shard.dim), shard.layout)


def _map_view(ctx: _Ctx, shard: Shard, in_shape: list[int], out_shape: list[int]) -> Shard:
    """Where a cut dim lands in a view: the output dim whose flat range holds the units."""
    d = len(in_shape) + shard.dim
    outer, units, inner = shard.layout
    stride = math.prod(in_shape[d + 1 :]) * inner  # flat distance between units
    span = stride * units
    for j in range(len(out_shape) - 1, -1, -1):
        size, out_stride = out_shape[j], math.prod(out_shape[j + 1 :])
        if size == 1:
            continue
        if stride % out_stride == 0 and (out_stride * size) % span == 0:
            return Shard(j - len(out_shape), ((out_stride * size) // span, units, stride // out_stride))
        if out_stride < stride:
            continue
        break
    ctx.fail(f"the view {in_shape} -> {out_shape} cuts across the split dimension")


def _localise(ctx: _Ctx, sizes: list, j: int, global_size: int):
    """The sizes list with entry j made this rank's (a literal or -1; a symbol cannot be)."""
    sizes = list(sizes)
    value = sizes[j]
    if isinstance(value, fx.Node) or not isinstance(value, int):
        ctx.fail(f"the split dimension's size is computed ({value}); write it as a literal or -1")
    if value != -1:
        if value != global_size:
            ctx.fail(f"size {value} on the split dimension, expected {global_size}")
        sizes[j] = value // ctx.tp
    return sizes


def _view(ctx: _Ctx) -> Shard:
    node = ctx.node
    source = node.args[0]
    shard = _map_view(ctx, ctx.the_shard(source), ctx.shape(source), ctx.shape(node))
    name = _op_name(node)
    if name in ("view", "reshape"):
        packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
        sizes = list(node.args[1]) if packed else list(node.args[1:])
        j = len(sizes) + shard.dim
        local = _localise(ctx, sizes, j, ctx.shape(node)[shard.dim])
        ctx.rewrite((source, tuple(local)) if packed else (source, *local))
    return shard


def _expand(ctx: _Ctx) -> Shard:
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
    sizes = list(node.args[1]) if packed else list(node.args[1:])
    local = _localise(ctx, sizes, len(sizes) + shard.dim, ctx.shape(node)[shard.dim])
    ctx.rewrite((node.args[0], tuple(local)) if packed else (node.args[0], *local))
    return shard


def _transpose(ctx: _Ctx) -> Shard:
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    d = ndim + shard.dim
    if _op_name(node) == "permute":
        order = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else list(node.args[1:])
        order = [o % ndim for o in order]
        return Shard(order.index(d) - ndim, shard.layout)
    a, b = (x % ndim for x in (_dim_arg(node, 1, 0, ndim), _dim_arg(node, 2, 1, ndim, key="dim1")))
    new = b if d == a else a if d == b else d
    return Shard(new - ndim, shard.layout)


def _getitem(ctx: _Ctx) -> Shard:
    node = ctx.node
    source, index = node.args
    shard = ctx.shard(source)
    if isinstance(shard, list):  # an element of unbind/chunk/split
        return shard[index]
    shard = ctx.the_shard(source)
    ndim = ctx.ndim(source)
    d = ndim + shard.dim
    index = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis not in index:
        index.append(Ellipsis)
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    at = index.index(Ellipsis)
    index[at : at + 1] = [slice(None)] * (ndim - consumed)
    in_dim = out_dim = 0
    found = None
    for item in index:
        if item is None:
            out_dim += 1
            continue
        if isinstance(item, fx.Node) or not isinstance(item, (int, slice)):
            ctx.fail("indexes with tensors")
        if in_dim == d:
            if item != slice(None):
                ctx.fail("indexes into the split dimension")
            found = out_dim
        in_dim += 1
        out_dim += 0 if isinstance(item, int) else 1
    return Shard(found - out_dim, shard.layout)


def _pieces(ctx: _Ctx) -> list[Shard]:
    """unbind / chunk / split: a list, one shard per piece."""
    node = ctx.node
    name = _op_name(node)
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    if name == "unbind":
        dim = _dim_arg(node, 1, 0, ndim) - ndim
        if dim == shard.dim:
            ctx.fail("unbinds the split dimension")
        new = Shard(shard.dim + (1 if dim > shard.dim else 0), shard.layout)
        return [new] * ctx.shape(node.args[0])[dim]
    dim = _dim_arg(node, 2, 0, ndim) - ndim
    n = ctx.shape(node.args[0])[dim]
    count = node.args[1] if name == "chunk" else None
    if name == "split":
        if not isinstance(node.args[1], int) or n % node.args[1]:
            ctx.fail("splits into unequal pieces")
        count = n // node.args[1]
    if dim != shard.dim:
        return [shard] * count
    outer, units, inner = shard.layout
    if outer % count:
        ctx.fail(f"cuts the split dimension into {count} pieces across heads/columns")
    if name == "split":
        ctx.rewrite((node.args[0], node.args[1] // ctx.tp, *node.args[2:]))
    return [Shard(shard.dim, (outer // count, units, inner))] * count


def _cat(ctx: _Ctx) -> Shard:
    node = ctx.node
    tensors = node.args[0]
    shards = [ctx.shard(t) for t in tensors]
    if not all(isinstance(s, Shard) for s in shards) or len({(s.dim, s.layout) for s in shards}) != 1:
        ctx.fail("concatenates values split differently (or not split)")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    ndim = ctx.ndim(tensors[0])
    if (dim % ndim) - ndim == shards[0].dim:
        ctx.fail("concatenates along the split dimension")
    return shards[0]


def _attention(ctx: _Ctx) -> Shard:
    node = ctx.node
    q, k, v = node.args[:3]
    shards = [ctx.the_shard(t) for t in (q, k, v)]
    if len({s.dim for s in shards}) != 1 or shards[0].dim >= -2:
        ctx.fail("q, k and v are not split along their heads")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        if ctx.shard(mask) is not None:
            ctx.fail("the mask is split")
        shape = ctx.shape(mask)
        if len(shape) >= -shards[0].dim and shape[shards[0].dim] != 1:
            ctx.fail("the mask has a heads dimension")
    return shards[0]


def _matmul(ctx: _Ctx) -> Shard:
    a, b = ctx.node.args[:2]
    sa, sb = ctx.the_shard(a), ctx.the_shard(b)
    if sa.dim != sb.dim or sa.dim > -3:
        ctx.fail("multiplies along the split dimension")
    return sa


def _sym_size(ctx: _Ctx):
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    if node.args[1] % ndim == ndim + shard.dim:
        ctx.fail("reads the size of the split dimension")
    return None


ELEMENTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "sin", "cos",
    "silu", "gelu", "relu", "dropout", "to", "float", "double", "half", "bfloat16", "type_as", "contiguous",
    "clone", "abs", "square", "erf", "softplus", "iadd", "imul", "where", "masked_fill", "_to_copy",
}  # fmt: skip
SHARD_RULES = {
    **{name: _elementwise for name in ELEMENTWISE},
    **{name: _reduction for name in ("mean", "sum", "amax", "amin", "var", "softmax", "log_softmax")},
    **{name: _view for name in ("view", "reshape", "flatten", "unsqueeze", "squeeze")},
    "expand": _expand,
    "transpose": _transpose,
    "swapaxes": _transpose,
    "permute": _transpose,
    "getitem": _getitem,
    "unbind": _pieces,
    "chunk": _pieces,
    "split": _pieces,
    "cat": _cat,
    "scaled_dot_product_attention": _attention,
    "matmul": _matmul,
    "bmm": _matmul,
    "sym_size.int": _sym_size,
}


# ------------------------------------------------------------------------------ rewrite


def _rewrite_block(graph: fx.Graph, block: Block, tp: int, shards: dict) -> dict[fx.Node, fx.Node]:
    """Rewrite one block in place; returns each replicated value -> the tp_copy it now enters through."""
    for node, args, kwargs in block.rewrites:
        node.args, node.kwargs = args, kwargs
    order = {n: i for i, n in enumerate(graph.nodes)}
    made = {}
    for value, consumers in block.copies.items():
        first = min(consumers, key=order.get)
        with graph.inserting_before(first):
            copy = graph.call_function(commfx.tp_copy.default, (value, GROUP))
        if "example_value" in value.meta:
            copy.meta["example_value"] = value.meta["example_value"]
        copy.meta["nn_module_stack"] = dict(first.meta.get("nn_module_stack", {}))
        stamp(copy, PASS, "enters the tensor-parallel block (input gradient all-reduced over tp)")
        made[value] = copy
        for consumer in consumers:
            consumer.replace_input_with(value, copy)
    for column in block.columns:
        weight, bias = column.args[1], _bias(column)
        shards[weight.target] = _spec(0, block.layouts[column], tp)
        if isinstance(bias, fx.Node):
            shards[bias.target] = _spec(0, block.layouts[column], tp)
        stamp(column, PASS, f"column-parallel: {block.layouts[column][1] // tp} of {block.layouts[column][1]} heads/columns")
    row = block.row
    weight, bias = row.args[1], _bias(row)
    shards[weight.target] = _spec(1, block.row_layout, tp)
    row.args = (row.args[0], weight, None)
    row.kwargs = {}
    stamp(row, PASS, "row-parallel: partial products over this rank's heads/columns")
    with graph.inserting_after(row):
        reduced = graph.call_function(commfx.all_reduce.default, (row, GROUP, f"{block.path} row-parallel output"))
    stamp(reduced, PASS, "sum the partial products over tp")
    reduced.meta["nn_module_stack"] = dict(row.meta.get("nn_module_stack", {}))
    out = reduced
    if isinstance(bias, fx.Node):
        with graph.inserting_after(reduced):
            out = graph.call_function(operator.add, (reduced, bias))
        out.meta["nn_module_stack"] = dict(row.meta.get("nn_module_stack", {}))
    for key in ("example_value", "val"):
        if key in row.meta:
            reduced.meta[key] = out.meta[key] = row.meta[key]
    for user in list(row.users):
        if user is not reduced:
            user.replace_input_with(row, out)
    return made


# ------------------------------------------------------------------------ unit functions

UNIT_BLOCKS = 8  # an MLP's unit: its intermediate columns on one rank in about this many blocks


def _unit_size(per: int, heads: bool) -> int:
    """Heads or columns in one unit: a head; for an MLP the fewest columns that cut one
    rank's share into at most UNIT_BLOCKS equal blocks."""
    if heads:
        return 1
    return next(g for g in range(1, per + 1) if per % g == 0 and per // g <= UNIT_BLOCKS)


def _unit_function(graph: fx.Graph, block: Block, nodes, linears, tp: int, sizes: "_Sizes") -> dict | None:
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
    units with it from the replicated input (runtime/resize.py)."""
    inner = block.row_layout[2]
    # the finest cut every linear of the block shares: a head (a kv group under grouped-query
    # attention, whose k/v have fewer heads than q), or one MLP column
    parts = math.gcd(block.row_layout[1], *(layout[1] for layout in block.layouts.values()))
    per = parts // tp
    try:
        planned = _plan_block(graph, block.path, nodes, linears, parts, sizes)
    except (Unsupported, _NotABlock):
        return None
    new_args = {node: (args, kwargs) for node, args, kwargs in planned.rewrites}
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside, sequence = set(block.columns), []
    for node in sorted((n for n in graph.nodes if min(order[c] for c in block.columns) <= order[n] <= order[block.row]), key=order.get):
        if node in inside or any(a in inside for a in node.all_input_nodes):
            inside.add(node)
            sequence.append(node)
    weights = {c.args[1] for c in [*block.columns, block.row]} | {_bias(c) for c in block.columns if isinstance(_bias(c), fx.Node)}
    externals = []
    for node in sequence:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in weights and arg not in externals and not (node is block.row and arg is _bias(node)):
                externals.append(arg)
    sub = fx.Graph()
    count = sub.placeholder("count")
    env = {e: sub.placeholder(f"input_{i}") for i, e in enumerate(externals)}
    columns = []
    for i, column in enumerate(block.columns):
        bias = _bias(column)
        env[column.args[1]] = sub.placeholder(f"weight_{i}")
        if isinstance(bias, fx.Node):
            env[bias] = sub.placeholder(f"bias_{i}")
        columns.append({"weight": column.args[1].target, "bias": bias.target if isinstance(bias, fx.Node) else None,
                        "layout": [block.layouts[column][0], block.layouts[column][1] // tp, block.layouts[column][2]]})
    env[block.row.args[1]] = sub.placeholder("row_weight")

    def scaled(old, new):
        """`new` with each literal the rules divided (old != new) as count x new."""
        if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
            return type(new)(scaled(o, n) for o, n in zip(old, new))
        if type(old) is int and type(new) is int and old != new:
            return new if new == -1 else sub.call_function(operator.mul, (count, new))
        return fx.map_arg(new, env.get)

    for node in sequence:
        if node in block.columns or node is block.row:
            args = (env[node.args[0]], env[node.args[1]], env.get(_bias(node)) if node in block.columns else None)
            env[node] = sub.call_function(F.linear, args)
        elif node in new_args:
            args, kwargs = new_args[node]
            env[node] = sub.call_function(node.target, scaled(node.args, args), scaled(node.kwargs, kwargs)) if node.op == "call_function" \
                else sub.call_method(node.target, scaled(node.args, args), scaled(node.kwargs, kwargs))
        else:
            env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(env[block.row])
    return {
        "graph": fx.GraphModule(torch.nn.Module(), sub), "externals": externals, "columns": columns,
        "row": {"weight": block.row.args[1].target, "layout": [block.row_layout[0], block.row_layout[1] // tp, block.row_layout[2]]},
        "unit": _unit_size(per, heads=inner > 1), "per_rank": per,
    }


def _bias(linear: fx.Node):
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


def _spec(dim: int, layout: tuple[int, int, int], tp: int) -> dict:
    return {"dim": dim, "group": GROUP, "parts": tp, "layout": list(layout), "replicated_over": "dp"}


# ------------------------------------------------------------------------------ helpers


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return f"{target._opname}.{target._overloadname}"
        return getattr(target, "__name__", str(target))
    return node.op


def _value(node):
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _shape(node) -> list | None:
    value = _value(node)
    return list(value.shape) if value is not None else None


def _shape_len(node) -> int:
    value = _value(node)
    return value.dim() if value is not None else -1


def _needs_grad(node: fx.Node) -> bool:
    value = _value(node)
    return value is not None and value.requires_grad and value.is_floating_point()


def _dim_arg(node: fx.Node, position: int, default: int, ndim: int, key: str = "dim") -> int:
    value = node.args[position] if len(node.args) > position else node.kwargs.get(key, default)
    return value % ndim if isinstance(value, int) and ndim > 0 else value


class _Sizes:
    """Concrete stand-ins for symbolic sizes: each symbol becomes a large distinct prime, so
    divisibility between sizes holds exactly when it holds for every value of the symbol."""

    PRIMES = (100003, 100019, 100043, 100049, 100057, 100069, 100103, 100109)

    def __init__(self):
        self.values: dict = {}

    def of(self, size) -> int:
        if isinstance(size, int):
            return size
        expr = size.node.expr
        for symbol in sorted(expr.free_symbols, key=str):
            if symbol not in self.values:
                self.values[symbol] = self.PRIMES[len(self.values) % len(self.PRIMES)] + 1000 * (len(self.values) // len(self.PRIMES))
        return int(expr.subs(self.values))
