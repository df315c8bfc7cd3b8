"""Row gradients of sparse and row-sharded embedding tables, exchanged into the next step.

`split_embedding_comm:schedule=2d` (EmbRace's 2D communication scheduling). The backward
of a 2d lookup (`commfx.post_row_grads`) coalesces the rank's token gradients into one row
per touched id and hands them here. Once the module knows the optimizer
(`dm.attach_optimizer`), the exchange is started and not waited for:

- each destination gets its rows in two parts: first the rows its next batch reads (the
  `rows_next` class, ahead of every gradient all-reduce), then every other row
  (`rows_later`, behind them). A replicated (sparse) table sends every row to every rank,
  urgent where that rank reads it next; a row-sharded table sends a row to its owner,
  urgent where any rank reads it next. The next batch's rows come from `next_batch`
  (`DistributedModule.next_batch`); a rank that gave none counts as reading every row.
- `optimizer.step()` skips the table (a pre-step hook notes the step's hyperparameters);
  the next forward's lookup of the table first `settle`s it: waits for its rows, adds them
  into the table gradient in rank order (the bits the step schedule computes) and steps the
  table alone with the noted hyperparameters. `synchronize()` (a checkpoint, the end of
  training) settles every table.

Without an attached optimizer (or in `commfx bench`'s compute-only replay) the exchange is
waited at once and the gradient returned, like `schedule=step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..kernels.embedding import accumulate_rows, coalesce_rows
from ..plan import register_priority_class
from .deferred_step import catching_up, hyperparameters_of, step_only

ROW_SCHEDULE = "row_schedule"  # CommScheduler.op_state key of the module's RowSchedule
NEXT_CLASS, LATER_CLASS = "rows_next", "rows_later"
KIND = "embedding_all_to_all"
# The 2d lookups (torch.ops.commfx.<name>): the index of their ids and table-name arguments.
ROW_OPS = {"row_embedding": (1, 3), "row_sharded_embedding": (3, 7)}
POST_OP = "post_row_grads"

register_priority_class(NEXT_CLASS, 80, "embedding row gradients the next forward reads (split_embedding_comm:schedule=2d)",
                        groups=("world", "ep"), overlaps_compute=True)
register_priority_class(LATER_CLASS, 110, "embedding row gradients the next forward does not read (schedule=2d)",
                        groups=("world", "ep"), overlaps_compute=True)


@dataclass
class Exchange:
    """One table's row gradients on the wire: (ids, rows) received per part, urgent first."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]
    local_rows: int
    offset: int  # the first global row this rank holds (row-sharded), else 0
    scale: float
    wrap: bool = False  # compute-only replay: ids fold into the table


@dataclass
class RowSchedule:
    scheduler: object  # CommScheduler
    params: dict[str, torch.nn.Parameter]  # table (weight name) -> its parameter
    graph: fx.GraphModule | None = None  # the captured program: where each table's ids come from
    optimizer: torch.optim.Optimizer | None = None
    next_rows: dict[str, torch.Tensor] = field(default_factory=dict)  # table -> sorted rows the next batch reads
    posted: dict[str, list[Exchange]] = field(default_factory=dict)
    missed: dict[str, tuple[list[dict], torch.Tensor | None]] = field(default_factory=dict)  # table -> step it missed
    caught_up: int = 0  # tables stepped after their optimizer step, so far

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Defer from now on: `optimizer`'s steps skip tables still on the wire; each is
        stepped when settled."""
        self.optimizer = optimizer
        self.scheduler.dispatcher.enforce_priority = True
        optimizer.register_step_pre_hook(self._before_step)

    @property
    def deferring(self) -> bool:
        return self.optimizer is not None and not self.scheduler.local_only

    @property
    def pending(self) -> bool:
        return bool(self.posted)

    # -- the next batch ---------------------------------------------------------------

    def set_next_batch(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """The rows each 2d table's lookups read on `inputs` (the graph's inputs, in order),
        computed from the captured graph's id computation; kept for the next posting."""
        self.next_rows = next_rows(self.graph, inputs) if self.graph is not None else {}
        return self.next_rows

    # -- backward: post ---------------------------------------------------------------

    def post(self, table: str, grad: torch.Tensor, ids: torch.Tensor, local_rows: int, padding_idx: int,
             layout: str, group: str, scale: float) -> torch.Tensor:
        """Start the exchange of this table's row gradients. Deferring: returns zeros (the
        optimizer skips the table until it is settled); else the reduced table gradient."""
        unique, summed = coalesce_rows(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), padding_idx)
        deferring = self.deferring and table in self.params
        known = gather_rows(self.scheduler, group, self.next_rows.pop(table, None), grad.device) if deferring else None
        exchange = start_exchange(self.scheduler, unique, summed, layout=layout, group=group, local_rows=local_rows,
                                  scale=scale, readers=known, tag=table)
        if not deferring:
            return reduce_exchanges([exchange], grad)
        self.posted.setdefault(table, []).append(exchange)
        return grad.new_zeros((local_rows, grad.shape[-1]))

    # -- optimizer step and settling ---------------------------------------------------

    def _before_step(self, optimizer, args, kwargs) -> None:
        if catching_up(optimizer) or not self.posted:
            return
        hyperparameters = hyperparameters_of(optimizer)
        for table in self.posted:
            if table in self.missed:
                raise RuntimeError("optimizer.step() twice while embedding rows were still on the wire; call synchronize() between")
            param = self.params[table]
            self.missed[table] = (hyperparameters, param.grad)
            param.grad = None  # not in this step; settle() steps it

    def settle(self, table: str | None = None) -> None:
        """Wait for `table`'s rows (every table by default), add them into its gradient and
        step it if its optimizer step came already."""
        for name in [table] if table is not None else list(self.posted):
            exchanges = self.posted.pop(name, None)
            if not exchanges:
                continue
            param = self.params[name]
            reduced = reduce_exchanges(exchanges, param)
            if name not in self.missed:  # no step yet (gradient accumulation): the next one uses it
                param.grad = reduced if param.grad is None else param.grad.add_(reduced)
                continue
            hyperparameters, earlier = self.missed.pop(name)
            param.grad = reduced if earlier is None else earlier.add_(reduced)
            step_only(self.optimizer, [param], hyperparameters)
            param.grad = None
            self.caught_up += 1


def row_schedule_of(scheduler) -> RowSchedule | None:
    return scheduler.op_state.get(ROW_SCHEDULE)


# ------------------------------------------------------------------------- exchanges


def gather_rows(scheduler, group: str, mine: torch.Tensor | None, device: torch.device) -> list[torch.Tensor | None]:
    """Every rank's next rows of a table (None: that rank gave no next batch)."""
    handle = scheduler.group(group)
    parts, ones = handle.size, [1] * handle.size
    mine_count = -1 if mine is None else int(mine.numel())
    counts = scheduler.all_to_all(torch.full((parts, 1), mine_count, dtype=torch.int64, device=device), ones, ones, group, "a2a", "next rows counts", KIND)
    counts = counts.reshape(-1).tolist()
    send = (mine if mine is not None else torch.zeros(0, dtype=torch.int64)).reshape(-1).to(device=device, dtype=torch.int64)
    received = scheduler.all_to_all(send.repeat(parts), [send.numel()] * parts, [max(c, 0) for c in counts], group, "a2a", "next rows", KIND)
    split = received.split([max(c, 0) for c in counts])
    return [None if c < 0 else s for c, s in zip(counts, split)]


def start_exchange(scheduler, unique: torch.Tensor, summed: torch.Tensor, *, layout: str, group: str, local_rows: int,
                   scale: float, readers: list[torch.Tensor | None] | None, tag: str) -> Exchange:
    """Queue the (id, row) pairs to their destinations in two parts: the rows each
    destination's next batch reads (NEXT_CLASS), then the others (LATER_CLASS). `readers`:
    every rank's next rows (None: unknown, so all urgent)."""
    handle = scheduler.group(group)
    parts = handle.size
    if layout == "shard":
        owner = torch.div(unique, local_rows, rounding_mode="floor")
        dests = [owner == r for r in range(parts)]
        known = readers is not None and all(r is not None for r in readers)
        union = torch.cat([r.to(unique.device) for r in readers]).unique() if known else None
        reads = [union] * parts
    else:
        dests = [torch.ones_like(unique, dtype=torch.bool)] * parts
        reads = [None if readers is None or readers[r] is None else readers[r].to(unique.device) for r in range(parts)]
    urgent = [d if read is None else d & torch.isin(unique, read) for d, read in zip(dests, reads)]
    later = [d & ~u for d, u in zip(dests, urgent)]
    sends = [[int(m.sum()) for m in masks] for masks in (urgent, later)]
    counts = torch.tensor([[a, b] for a, b in zip(*sends)], dtype=torch.int64, device=unique.device)
    ones = [1] * parts
    got = scheduler.all_to_all(counts, ones, ones, group, "a2a", f"{tag} row counts", KIND).tolist()
    received = []
    for part, (masks, send, priority) in enumerate(zip((urgent, later), sends, (NEXT_CLASS, LATER_CLASS))):
        recv = [row[part] for row in got]
        ids = torch.cat([unique[m] for m in masks])
        rows = torch.cat([summed[m] for m in masks])
        received.append((
            scheduler.start_all_to_all(ids, send, recv, group, priority, f"{tag} row ids ({priority})", KIND),
            scheduler.start_all_to_all(rows, send, recv, group, priority, f"{tag} row grads ({priority})", KIND),
        ))
    offset = handle.rank * local_rows if layout == "shard" else 0
    return Exchange(received, local_rows, offset, scale, wrap=scheduler.local_only)


def reduce_exchanges(exchanges: list[Exchange], like: torch.Tensor) -> torch.Tensor:
    """The table gradient: each exchange's rows added into zeros (urgent part, then the
    rest: every row's contributions arrive in one part, in rank order), scaled; several
    exchanges (backward passes before a step) summed in their order."""
    from .comm import current_scheduler

    scheduler = current_scheduler()
    total = None
    for exchange in exchanges:
        table = like.new_zeros((exchange.local_rows, like.shape[-1]))
        for ids, rows in exchange.parts:
            scheduler.wait_tensor(ids)
            scheduler.wait_tensor(rows)
            local = ids.remainder(exchange.local_rows) if exchange.wrap else ids - exchange.offset
            accumulate_rows(table, local, rows.to(table.dtype))
        if exchange.scale != 1.0:
            table.mul_(exchange.scale)
        total = table if total is None else total.add_(table)
    return total


# --------------------------------------------------------------- next batch's rows


def next_rows(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """table -> the sorted rows its 2d lookups read on `inputs`, computed by the captured
    graph's own nodes between the inputs and each lookup's ids (no parameter is read). A
    table whose ids need more (a parameter, a collective) is left out: all its rows go first."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, object] = dict(zip(placeholders, inputs))
    found: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            spec = _row_op(node)
            if spec is None:
                continue
            ids_at, table_at = spec
            try:
                ids = _evaluate(gm, node.args[ids_at], env)
            except _Unknown:
                found[node.args[table_at]] = None
                continue
            if node.args[table_at] in found and found[node.args[table_at]] is None:
                continue
            found.setdefault(node.args[table_at], []).append(ids.reshape(-1))
    return {table: torch.cat(ids).unique() for table, ids in found.items() if ids is not None}


class _Unknown(Exception):
    pass


def _row_op(node: fx.Node) -> tuple[int, int] | None:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != "commfx":
        return None
    return ROW_OPS.get(target._opname)


def _evaluate(gm: fx.GraphModule, node, env: dict):
    if not isinstance(node, fx.Node):
        return node
    if node in env:
        return env[node]
    if node.op != "call_function" or getattr(node.target, "namespace", None) == "commfx":
        raise _Unknown(node)
    args = map_arg(node.args, lambda n: _evaluate(gm, n, env))
    kwargs = map_arg(node.kwargs, lambda n: _evaluate(gm, n, env))
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values())):
        raise _Unknown(node)
    env[node] = value = node.target(*args, **kwargs)
    return value


def hoist_row_posts(gm: fx.GraphModule) -> int:
    """Move each row-gradient posting of a backward graph right after its last input (and
    after the previous posting: their order is the exchanges' order on every rank), so its
    exchange starts before the rest of the backward. Returns how many moved."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    previous, moved = None, 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and getattr(node.target, "namespace", None) == "commfx" and node.target._opname == POST_OP):
            continue
        anchors = list(node.all_input_nodes) + ([previous] if previous is not None else [])
        anchor = max(anchors, key=position.__getitem__)
        if anchor.next is not node:
            anchor.append(node)
            moved += 1
        previous = node
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


__all__ = ["ROW_SCHEDULE", "NEXT_CLASS", "LATER_CLASS", "RowSchedule", "hoist_row_posts", "next_rows", "row_schedule_of"]
