"""split_embedding_comm's row exchanges as the simulator sizes and schedules them.

Sizes follow `cost.embedding`: a lookup of T ids touches U = min(T, V) rows of its table
(uniform ids: an upper bound). A row-sharded table sends its U unique ids to their owners
and gets the rows back (forward), and sends the row gradients back to the owners
(backward); a replicated (sparse) table sends its U (id, row gradient) pairs to every rank.

`schedule=2d` (`runtime/row_schedule.py`): the backward coalesces a table's rows, then
exchanges the next batch's rows and the per-destination counts (three small all-to-alls on
the critical path) and posts the pairs in two parts without waiting: the rows the next
batch reads (`rows_next`, ahead of the gradient all-reduce; their share from
`cost.embedding.next_share`) and the rest (`rows_later`, behind it). The optimizer step
skips the table; the next forward's lookup waits for the first part only, adds it in and
steps the rows the batch reads (the same share of the table); the other rows are stepped
before the next optimizer step, once the rest is in. So the urgent part overlaps the
optimizer step and whatever the next forward computes before the lookup, the rest the
whole next forward and backward, and the engine runs such a workload for two steps (the
second is the steady state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from ..compiler.program import Program
from ..cost.embedding import ID_BYTES, next_share
from ..cost.flops import hint
from ..plan import DEFAULT_CLASS
from ..runtime.row_schedule import LATER_CLASS, NEXT_CLASS
from .workload import Comm, Item

LOOKUPS = {"row_embedding": "replicated", "row_sharded_embedding": "shard"}  # schedule=2d's lookups -> layout
COUNTS_BYTES = 64.0  # a count exchange: latency only


@dataclass(frozen=True)
class Table:
    rows: int  # the whole table's
    row_bytes: int  # one row of its gradient
    step_bytes: float  # what AdamW reads and writes to step this rank's part (p, g, m, v)


class RowTables:
    """The program's embedding tables, to size their exchanges and their deferred steps."""

    def __init__(self, program: Program):
        params = dict(program.gm.named_parameters())
        self.tables: dict[str, Table] = {}
        for table in program.regions.embeddings:
            param = params.get(table.weight)
            if param is None:
                continue
            shard = program.runtime.shards.get(table.weight)
            local = param.numel() // (shard["parts"] if shard else 1)
            self.tables[table.weight] = Table(table.num_rows, table.dim * param.element_size(), 8.0 * local * param.element_size())
        self.deferred: set[str] = set()  # tables whose step moved to their next lookup

    def unique(self, table: str, tokens: float) -> float:
        """Rows a lookup of `tokens` ids touches (at most the table's)."""
        found = self.tables.get(table)
        return min(tokens, found.rows) if found else tokens

    # -- schedule=step ----------------------------------------------------------------

    def pairs_bytes(self, weight: fx.Node, tokens: float, row_bytes: float) -> float:
        """A rank's coalesced (id, row gradient) pairs of the table `weight` reads."""
        return self.unique(str(getattr(weight, "target", "")), tokens) * (row_bytes + ID_BYTES)

    def size(self, comm: Comm, node: fx.Node, rows_factor: float) -> None:
        """A row-sharded lookup's all-to-alls (nodes a pass made, with no traced value):
        its unique ids to their owners (no backward: ids have no gradient) and the rows back
        (reversed in the backward: row gradients to their owners)."""
        table, _, what = comm.tag.rpartition(" ")
        if comm.payload or table not in self.tables or what not in ("ids", "rows"):
            return
        unique = self.unique(table, _routed_ids(node) * rows_factor)
        comm.payload = unique * (ID_BYTES if what == "ids" else self.tables[table].row_bytes)
        comm.reversed_in_backward = what == "rows"

    # -- schedule=2d ------------------------------------------------------------------

    def before(self, node: fx.Node, name: str, counter, rows_factor: float) -> list[Item]:
        """Ahead of a 2d lookup: wait for the table's rows of the step before that this batch
        reads and step those (the rest of the table is "later": stepped before the optimizer
        step); for a row-sharded table, the owners' rows back to this rank."""
        layout = LOOKUPS.get(name)
        if layout is None:
            return []
        tokens = _ids_count(_lookup_ids(node, name)) * rows_factor
        table = self._table(node, layout)
        self.deferred.add(table)
        found = self.tables.get(table)
        unique = self.unique(table, tokens)
        row = found.row_bytes if found else 0
        parts = self._parts(node, layout)
        received = unique * row * (parts if layout == "replicated" else 1)
        work = (found.step_bytes if found else 0.0) + 2 * received  # add the rows in, step the table
        read = next_share(found.rows if found else 0, tokens, parts if layout == "shard" else 1)  # of the table, read next
        items = [Item("settle", node.name, "forward", label=table, nbytes=read * work),
                 Item("later", node.name, "forward", label=table, nbytes=(1.0 - read) * work)]
        if layout == "shard":
            back = Comm(next(counter), "all_to_all", "all_to_all", self._group(node, layout), DEFAULT_CLASS, f"{table} rows",
                        unique * row, reversed_in_backward=False)
            items += [Item("start", node.name, "forward", comm=back), Item("wait", node.name, "forward", comm_id=back.id)]
        return items

    def after(self, node: fx.Node, name: str, counter, rows_factor: float) -> list[Item]:
        """After a 2d lookup: what its backward does with the rows' gradients (a placeholder
        the mirror expands: coalesce, the small exchanges, the two posted parts)."""
        layout = LOOKUPS.get(name)
        if layout is None:
            return []
        tokens = _ids_count(_lookup_ids(node, name)) * rows_factor
        table = self._table(node, layout)
        found = self.tables.get(table)
        row = found.row_bytes if found else 0
        unique = self.unique(table, tokens)
        parts = self._parts(node, layout)
        group = self._group(node, layout)
        share = next_share(found.rows if found else 0, tokens, parts if layout == "shard" else 1)
        copies = parts if layout == "replicated" else 1  # a replicated table's pairs go to every rank
        small = [Comm(next(counter), "all_to_all", "all_to_all", group, DEFAULT_CLASS, tag, size)
                 for tag, size in (("next rows counts", COUNTS_BYTES), ("next rows", parts * unique * ID_BYTES),
                                   (f"{table} row counts", COUNTS_BYTES))]
        backward = [Item("compute", node.name, "backward", label="coalesce rows", nbytes=3 * tokens * row)]
        for comm in small:
            backward += [Item("start", node.name, "backward", comm=comm), Item("wait", node.name, "backward", comm_id=comm.id)]
        for priority, part in ((NEXT_CLASS, share), (LATER_CLASS, 1.0 - share)):
            for what, size in (("ids", ID_BYTES), ("grads", row)):
                comm = Comm(next(counter), "all_to_all", "all_to_all", group, priority, f"{table} row {what} ({priority})",
                            copies * part * unique * size)
                backward.append(Item("post", node.name, "backward", label=table, comm=comm))
        return [Item("rows", node.name, "forward", label=table, backward=backward)]

    @staticmethod
    def _table(node: fx.Node, layout: str) -> str:
        return node.args[3] if layout == "replicated" else node.args[7]

    @staticmethod
    def _group(node: fx.Node, layout: str) -> str:
        return node.args[4] if layout == "replicated" else node.args[8]

    @staticmethod
    def _parts(node: fx.Node, layout: str) -> int:
        return int(node.args[5] if layout == "replicated" else node.args[9])


def _ids_count(ids) -> float:
    """Elements of a node's traced value (0 without one)."""
    value = ids.meta.get("example_value", ids.meta.get("val")) if isinstance(ids, fx.Node) else None
    return float(math.prod(hint(s) for s in value.shape)) if value is not None and hasattr(value, "shape") else 0.0


def _routed_ids(node: fx.Node) -> float:
    """How many ids the row-sharded lookup behind `node` routes: the traced ids that its
    `commfx.embedding_route` reads (0 when none is found)."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if getattr(current.target, "_opname", None) == "embedding_route":
            return _ids_count(current.args[0])
        todo += current.all_input_nodes
    return 0.0


def _lookup_ids(node: fx.Node, name: str) -> fx.Node | None:
    """The ids a 2d lookup reads (its tokens)."""
    layout = LOOKUPS.get(name)
    if layout is None:
        return None
    return node.args[1] if layout == "replicated" else node.args[3]
