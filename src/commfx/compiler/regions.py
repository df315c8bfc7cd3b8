"""Typed regions: what passes find in a graph and leave for later passes.

A region holds graph nodes, not their names, so a later pass reaches a block's dispatch or
experts however many passes rewrote the graph in between. The rewrite engine keeps them
current: when it replaces a node, or copies the graph, every region that held the old node
holds the new one (`Regions.remap`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


@dataclass(eq=False)
class ExpertExchange:
    """What expert_parallel built around a block's experts, for later passes to re-cut:

        rows -> received (all-to-all) -> grouped -> experts(local_counts) -> back -> returned (all-to-all)
    """

    rows: fx.Node  # the dispatched rows, expert-major
    counts: fx.Node  # rows per global expert
    send_counts: fx.Node  # [ep, local experts]
    recv_counts: fx.Node
    received: fx.Node
    grouped: fx.Node
    local_counts: fx.Node
    back: fx.Node
    returned: fx.Node

    def nodes(self) -> tuple[fx.Node, ...]:
        """The nodes a re-cut replaces, users first."""
        return self.returned, self.back, self.local_counts, self.grouped, self.received


@dataclass(eq=False)
class PackedExchange:
    """What pack_experts built between a block's packed dispatch and its combine: the
    exchange's inputs (for re-cutting it into chunks) and every node of it."""

    rows: fx.Node
    meta: fx.Node
    send: fx.Node
    recv_counts: fx.Node
    nodes: list[fx.Node]


@dataclass(eq=False)
class MoEBlock:
    """One lifted MoE block: `dispatch -> experts -> combine`, with the collectives the
    expert-parallel passes put between them."""

    path: str
    pattern: str  # the recogniser that matched it
    num_experts: int
    top_k: int
    gate_up: str  # parameter targets of the stacked expert weights
    down: str
    activation: str
    router: str | None  # the router's module path, if lift found one
    dispatch: fx.Node  # commfx.moe_dispatch (commfx.rank_dispatch once packed)
    experts: list[fx.Node]  # the expert calls, one per chunk
    combine: fx.Node
    exchange: ExpertExchange | None = None  # expert_parallel's
    packed: PackedExchange | None = None  # pack_experts' (in place of `exchange`)
    chunks: int = 1
    gate: str | None = None  # locality_gate's router, when it replaced the model's
    dispatch_codec: str = "rows"  # how dispatch rows cross (expert_parallel:dispatch; passes/dispatch_codec.py)


@dataclass(eq=False)
class EmbeddingTable:
    weight: str  # parameter target
    path: str
    num_rows: int
    dim: int
    padding_idx: int
    trainable: bool
    lookups: list[fx.Node] = field(default_factory=list)
    tied_with: list[str] = field(default_factory=list)  # other uses of the weight (an LM head)

    @property
    def tied(self) -> bool:
        return bool(self.tied_with)


@dataclass(eq=False)
class LMHead:
    """A linear whose logits feed only a cross-entropy: it can be split over the vocabulary."""

    weight: str
    num_rows: int
    dim: int
    loss: fx.Node
    linear: fx.Node
    ignore_index: int
    reduction: str


@dataclass(eq=False)
class TPBlock:
    """A tensor-parallel block: column-parallel linears feeding one row-parallel linear."""

    path: str
    columns: list[fx.Node]
    row: fx.Node
    units: int  # heads / MLP column blocks the block's width is cut into
    unit_function: dict | None = None  # the block as a function of its units (resize_tp migration)
    unit_inputs: list[fx.Node] = field(default_factory=list)  # the unit function's inputs from outside the block


@dataclass
class Regions:
    """Every region of a program, and what recognisers kept verbatim (and why)."""

    moe_blocks: list[MoEBlock] = field(default_factory=list)
    unmatched_moe: list[str] = field(default_factory=list)
    kept_routers: list[str] = field(default_factory=list)
    embeddings: list[EmbeddingTable] = field(default_factory=list)
    kept_embeddings: list[str] = field(default_factory=list)
    lm_heads: list[LMHead] = field(default_factory=list)
    kept_heads: list[str] = field(default_factory=list)
    tp_blocks: list[TPBlock] = field(default_factory=list)
    tp_skipped: list[str] = field(default_factory=list)
    tp_plan: Any = None  # TPPlan: the inferred plan, torchtitan style
    pipeline: Any = None  # compiler.stages.Pipeline once pipeline_split ran

    def remap(self, mapping: dict[fx.Node, fx.Node]) -> None:
        """Every node a region holds that `mapping` names becomes its image."""
        if mapping:
            for region in (*self.moe_blocks, *self.embeddings, *self.lm_heads, *self.tp_blocks):
                _remap_fields(region, mapping)

    def remapped(self, mapping: dict[fx.Node, fx.Node]) -> Regions:
        """A copy whose regions hold `mapping`'s images (for a program on a copied graph)."""
        copy = Regions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for name in ("moe_blocks", "embeddings", "lm_heads", "tp_blocks"):
            setattr(copy, name, [_copied(region) for region in getattr(self, name)])
        copy.remap(mapping)
        return copy


def _copied(region):
    fields = {f.name: getattr(region, f.name) for f in dataclasses.fields(region)}
    for name, value in fields.items():
        if isinstance(value, list):
            fields[name] = list(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields[name] = _copied(value)
    return type(region)(**fields)


def _remap_fields(region, mapping: dict[fx.Node, fx.Node]) -> None:
    for f in dataclasses.fields(region):
        value = getattr(region, f.name)
        if isinstance(value, fx.Node):
            setattr(region, f.name, mapping.get(value, value))
        elif isinstance(value, list) and any(isinstance(v, fx.Node) for v in value):
            setattr(region, f.name, [mapping.get(v, v) if isinstance(v, fx.Node) else v for v in value])
        elif isinstance(value, (ExpertExchange, PackedExchange)):
            _remap_fields(value, mapping)
