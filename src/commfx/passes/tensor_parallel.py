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
import operator
import warnings

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.commfx)
from ..compiler.program import TP_PARTS, Program, stamp
from ..compiler.regions import TPBlock
from ..compiler.rewrite import Rewriter
from ..plan import Plan, PlanError, divisors
from .base import Pass, PassError, register
from .tp_blocks import Block, NotABlock, bias_of, is_linear, plan_block, regions_innermost_first, uncast
from ..compiler.shard_propagation import Sizes, Unsupported
from .tp_units import unit_function

commfx = torch.ops.commfx
PASS = "tensor_parallel"
GROUP = "tp"


@dataclasses.dataclass(frozen=True)
class PlannedBlock:
    """One split block of the inferred plan: its column-parallel linears, its row-parallel
    one (module paths of their weights) and how many heads or columns its ranks share."""

    path: str
    colwise: tuple[str, ...]
    rowwise: str
    units: int
    unit: str  # "heads" or "columns"

    def line(self) -> str:
        """`model.layers.0.self_attn: q_proj,k_proj,v_proj colwise; o_proj rowwise (4 heads)`."""
        short = lambda name: name[len(self.path) + 1:] if self.path and name.startswith(self.path + ".") else name  # noqa: E731
        return f"{self.path or '<root>'}: {','.join(short(c) for c in self.colwise)} colwise; {short(self.rowwise)} rowwise ({self.units} {self.unit})"


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """The plan tensor_parallel inferred, torchtitan style: which linear is split how."""

    tp: int
    blocks: tuple[PlannedBlock, ...]

    @property
    def styles(self) -> dict[str, str]:
        """Module path of each split linear -> "colwise" or "rowwise" (torchtitan's
        `{"attention.wq": colwise_parallel(), ...}`), in graph order."""
        return {name: style for b in self.blocks for name, style in [*((c, "colwise") for c in b.colwise), (b.rowwise, "rowwise")]}

    def lines(self) -> list[str]:
        return [b.line() for b in self.blocks]


@register(PASS, ensures="tensor parallel")
class TensorParallel(Pass):
    """Megatron column/row parallel attention (heads) and MLPs (columns) over the `tp` group.

    (Shoeybi et al. 2019, Megatron-LM; the substrate ZERO-resizing and migration resize.)
    """

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
        sizes = Sizes()
        claimed: set[fx.Node] = set()
        blocks, skipped, members = [], [], {}
        unsplittable: set[fx.Node] = set()  # linears of a block already reported: enclosing modules leave them out
        for path, nodes in regions_innermost_first(graph):
            linears = [n for n in nodes if is_linear(n) and n not in claimed and n not in unsplittable]
            try:
                block = plan_block(graph, path, nodes, linears, tp, sizes)
            except NotABlock:
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
        regions = program.regions
        regions.tp_plan, regions.tp_skipped = _plan(blocks, tp), skipped
        # Each block's unit function, planned on the graph before any block is rewritten.
        units = {b.path: unit_function(graph, b, *members[b.path], tp, sizes) for b in blocks}
        rw = Rewriter(program, PASS)
        for block in blocks:
            copies = _rewrite_block(rw, block, tp, program.runtime.shards)
            function = units[block.path]
            # the unit function reads the tp_copy where one was made
            inputs = [copies.get(e, e) for e in function.pop("externals")] if function is not None else []
            regions.tp_blocks.append(TPBlock(block.path, list(block.columns), block.row, block.row_layout[1], function, inputs))
        program.notes.extend(_note(regions.tp_plan, skipped))
        rw.finish()
        return True


def _plan(blocks: list[Block], tp: int) -> TPPlan:
    """The plan the blocks amount to, keyed by the module path of each linear's weight (the
    block's own path is the linears' common module prefix, in the same naming)."""
    module = lambda linear: linear.args[1].target.removesuffix(".weight")  # noqa: E731
    planned = []
    for b in blocks:
        colwise, rowwise = tuple(module(c) for c in b.columns), module(b.row)
        parts = [name.split(".") for name in (*colwise, rowwise)]
        common = next((i for i in range(min(map(len, parts))) if len({p[i] for p in parts}) > 1), min(map(len, parts)))
        planned.append(PlannedBlock(".".join(parts[0][:common]), colwise, rowwise, b.row_layout[1],
                                    "heads" if b.row_layout[2] > 1 else "columns"))
    return TPPlan(tp, tuple(planned))


def _note(plan: TPPlan, skipped: list[str]) -> list[str]:
    """What the pass split and what it left replicated, for `commfx dump`: a summary, then
    the inferred plan one block a line (`commfx dump` prints each note as one comment line)."""
    note = f"tensor_parallel splits {len(plan.blocks)} block(s) over tp={plan.tp}, plan below"
    if skipped:
        note += f"; leaves {len(skipped)} replicated (tensor_parallel:strict=true makes this an error): " + "; ".join(skipped)
    return [note, *(f"tensor_parallel plan: {line}" for line in plan.lines())]


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


# ------------------------------------------------------------------------------ rewrite


def _rewrite_block(rw: Rewriter, block: Block, tp: int, shards: dict) -> dict[fx.Node, fx.Node]:
    """Rewrite one block in place; returns each replicated value -> the tp_copy it now enters through."""
    for node, args, kwargs in block.rewrites:
        node.args, node.kwargs = args, kwargs
    for node in (*block.split, block.row):  # traced at full width: this rank computes 1/tp of each (cost models read it)
        node.meta[TP_PARTS] = tp
    order = {n: i for i, n in enumerate(rw.graph.nodes)}
    made = {}
    for value, consumers in block.copies.items():
        first = min(consumers, key=order.get)
        with rw.before(first):
            copy = rw.call(commfx.tp_copy.default, (value, GROUP), like=first,
                           purpose="enters the tensor-parallel block (input gradient all-reduced over tp)")
        if "example_value" in value.meta:
            copy.meta["example_value"] = value.meta["example_value"]
        made[value] = copy
        for consumer in consumers:
            consumer.replace_input_with(value, copy)
    for column in block.columns:
        weight, bias = uncast(column.args[1]), uncast(bias_of(column))
        shards[weight.target] = _spec(0, block.layouts[column], tp)
        if isinstance(bias, fx.Node):
            shards[bias.target] = _spec(0, block.layouts[column], tp)
        stamp(column, PASS, f"column-parallel: {block.layouts[column][1] // tp} of {block.layouts[column][1]} heads/columns")
    row = block.row
    weight, bias = row.args[1], bias_of(row)  # under mixed precision, casts of the parameters
    shards[uncast(weight).target] = _spec(1, block.row_layout, tp)
    row.args = (row.args[0], weight, None)
    row.kwargs = {}
    stamp(row, PASS, "row-parallel: partial products over this rank's heads/columns")
    keep = ("example_value", "val")
    with rw.after(row):
        reduced = rw.call(commfx.all_reduce.default, (row, GROUP, f"{block.path} row-parallel output"), like=row, keep=keep,
                          purpose="sum the partial products over tp")
    out = reduced
    if isinstance(bias, fx.Node):
        with rw.after(reduced):
            out = rw.call(operator.add, (reduced, bias), like=row, keep=keep)
    for user in list(row.users):
        if user is not reduced:
            user.replace_input_with(row, out)
    return made


def _spec(dim: int, layout: tuple[int, int, int], tp: int) -> dict:
    return {"dim": dim, "group": GROUP, "parts": tp, "layout": list(layout), "replicated_over": "dp"}
