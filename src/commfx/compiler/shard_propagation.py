"""How tensor_parallel follows a split dimension through a block, op by op.

A value cut along one dim is a `Shard` (dim, layout); a layout (outer, units, inner) says how
the dim is numbered: units are heads (inner = head dim) or columns, and a fused q/k/v has
outer 3. `SHARD_RULES` maps an op's name to its rule: given the shards of the op's inputs
(a `RuleContext`), a rule returns the shard of its output, records new arguments where a
literal size must become this rank's (`view(b, s, 3, 4, 8)` -> `view(b, s, 3, 2, 8)` at
tp=2), or raises `Unsupported` saying which node and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ops.tp import shard_index


class Unsupported(Exception):
    """This block cannot be split (the message says which node and why)."""


@dataclass(frozen=True)
class Shard:
    """A value cut along `dim` (negative: counted from the last dim) by `layout`."""

    dim: int
    layout: tuple[int, int, int]  # (outer, units, inner), row-major numbering of the dim


class RuleContext:
    """What a rule sees: the node, the shards of its inputs, concrete sizes, tp; `rewrite`
    records new arguments for the node (a literal size made local)."""

    def __init__(self, node, shards, sizes, tp, rewrites):
        self.node, self.shards, self.sizes, self.tp, self._rewrites = node, shards, sizes, tp, rewrites

    def shard(self, value) -> Shard | None:
        return self.shards.get(value) if isinstance(value, fx.Node) else None

    def the_shard(self, value) -> Shard:
        shard = self.shard(value)
        if not isinstance(shard, Shard):
            raise Unsupported(f"{self.node.name} ({op_name(self.node)}) needs {getattr(value, 'name', value)} split")
        return shard

    def ndim(self, value) -> int:
        return ndim_of(value)

    def shape(self, value) -> list[int]:
        return [self.sizes.of(s) for s in shape_of(value)]

    def rewrite(self, args, kwargs=None):
        self._rewrites.append((self.node, tuple(args), dict(self.node.kwargs if kwargs is None else kwargs)))

    def fail(self, why: str):
        raise Unsupported(f"{self.node.name} ({op_name(self.node)}): {why}")


def _same(a: Shard, b: Shard, sizes_a: list[int], sizes_b: list[int], tp: int) -> bool:
    """Whether two shards cut equal-sized dims into the same index sets on every rank."""
    if a.dim != b.dim or sizes_a[a.dim] != sizes_b[b.dim]:
        return False
    return all(torch.equal(shard_index(a.layout, r, tp), shard_index(b.layout, r, tp)) for r in range(tp))


def _elementwise(ctx: RuleContext) -> Shard:
    node = ctx.node
    tensors = [node.args[0]] if op_name(node) in ("to", "type_as", "float", "double", "half", "bfloat16") else [
        a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and shape_of(a) is not None
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


def _reduction(ctx: RuleContext) -> Shard:
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or isinstance(dims, fx.Node):
        ctx.fail("reduces over every dimension")
    dims = [d - ndim if d >= 0 else d for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if shard.dim in dims:
        ctx.fail("reduces over the split dimension")
    keep = op_name(node) in ("softmax", "log_softmax") or (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if keep:
        return shard
    return Shard(shard.dim + sum(1 for d in dims if d > shard.dim), shard.layout)


def _map_view(ctx: RuleContext, shard: Shard, in_shape: list[int], out_shape: list[int]) -> Shard:
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


def _localise(ctx: RuleContext, sizes: list, j: int, global_size: int):
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


def _view(ctx: RuleContext) -> Shard:
    node = ctx.node
    source = node.args[0]
    shard = _map_view(ctx, ctx.the_shard(source), ctx.shape(source), ctx.shape(node))
    name = op_name(node)
    if name in ("view", "reshape"):
        packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
        sizes = list(node.args[1]) if packed else list(node.args[1:])
        j = len(sizes) + shard.dim
        local = _localise(ctx, sizes, j, ctx.shape(node)[shard.dim])
        ctx.rewrite((source, tuple(local)) if packed else (source, *local))
    return shard


def _expand(ctx: RuleContext) -> Shard:
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
    sizes = list(node.args[1]) if packed else list(node.args[1:])
    local = _localise(ctx, sizes, len(sizes) + shard.dim, ctx.shape(node)[shard.dim])
    ctx.rewrite((node.args[0], tuple(local)) if packed else (node.args[0], *local))
    return shard


def _transpose(ctx: RuleContext) -> Shard:
    node = ctx.node
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    d = ndim + shard.dim
    if op_name(node) == "permute":
        order = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else list(node.args[1:])
        order = [o % ndim for o in order]
        return Shard(order.index(d) - ndim, shard.layout)
    a, b = (x % ndim for x in (dim_arg(node, 1, 0, ndim), dim_arg(node, 2, 1, ndim, key="dim1")))
    new = b if d == a else a if d == b else d
    return Shard(new - ndim, shard.layout)


def _getitem(ctx: RuleContext) -> Shard:
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


def _pieces(ctx: RuleContext) -> list[Shard]:
    """unbind / chunk / split: a list, one shard per piece."""
    node = ctx.node
    name = op_name(node)
    shard = ctx.the_shard(node.args[0])
    ndim = ctx.ndim(node.args[0])
    if name == "unbind":
        dim = dim_arg(node, 1, 0, ndim) - ndim
        if dim == shard.dim:
            ctx.fail("unbinds the split dimension")
        new = Shard(shard.dim + (1 if dim > shard.dim else 0), shard.layout)
        return [new] * ctx.shape(node.args[0])[dim]
    dim = dim_arg(node, 2, 0, ndim) - ndim
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


def _cat(ctx: RuleContext) -> Shard:
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


def _attention(ctx: RuleContext) -> Shard:
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


def _matmul(ctx: RuleContext) -> Shard:
    a, b = ctx.node.args[:2]
    sa, sb = ctx.the_shard(a), ctx.the_shard(b)
    if sa.dim != sb.dim or sa.dim > -3:
        ctx.fail("multiplies along the split dimension")
    return sa


def _sym_size(ctx: RuleContext):
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


# ------------------------------------------------------------------------------ helpers


def op_name(node: fx.Node) -> str:
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


def shape_of(node) -> list | None:
    value = _value(node)
    return list(value.shape) if value is not None else None


def ndim_of(node) -> int:
    value = _value(node)
    return value.dim() if value is not None else -1


def needs_grad(node: fx.Node) -> bool:
    value = _value(node)
    return value is not None and value.requires_grad and value.is_floating_point()


def dim_arg(node: fx.Node, position: int, default: int, ndim: int, key: str = "dim") -> int:
    value = node.args[position] if len(node.args) > position else node.kwargs.get(key, default)
    return value % ndim if isinstance(value, int) and ndim > 0 else value


class Sizes:
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
