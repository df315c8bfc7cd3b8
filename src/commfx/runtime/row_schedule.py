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
  the next forward's lookup of the table waits only for the first part, adds it into the
  table gradient in rank order (the bits the step schedule computes) and steps just the
  rows the batch reads, with the noted hyperparameters (`row_step.py`). The other rows are
  stepped once their part has arrived (checked at each lookup and posting), at the latest
  before the table's next optimizer step, a lookup that reads them, an eval call or
  `synchronize()` (a checkpoint, the end of training). Under an optimizer whose update is
  not elementwise (`row_step.splits_by_rows`) the lookup waits for both parts and steps
  the table whole.

Without an attached optimizer (or in `commfx bench`'s compute-only replay) the exchange is
waited at once and the gradient returned, like `schedule=step`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..kernels.embedding import accumulate_rows, coalesce_rows
from ..plan import register_priority_class
from .deferred_step import catching_up, hyperparameters_of, step_only
from .row_step import splits_by_rows, state_before, step_rows

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

_NOTED: set[str] = set()  # optimizer classes the whole-table note was printed for


@dataclass
class Exchange:
    """One table's row gradients on the wire: (ids, rows) received per part, urgent first,
    added into `sums` (unscaled) part by part as they are received."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]
    local_rows: int
    offset: int  # the first global row this rank holds (row-sharded), else 0
    scale: float
    wrap: bool = False  # compute-only replay: ids fold into the table
    first: torch.Tensor | None = None  # local rows whose every gradient is in the first part (sorted); None: all
    sums: torch.Tensor | None = None
    received: int = 0  # parts added into `sums`

    def receive(self, scheduler, like: torch.Tensor, parts: int) -> torch.Tensor:
        """Wait for the first `parts` parts and add those not added yet into `sums`."""
        if self.sums is None:
            self.sums = like.new_zeros((self.local_rows, like.shape[-1]))
        while self.received < parts:
            ids, rows = self.parts[self.received]
            scheduler.wait_tensor(ids)
            scheduler.wait_tensor(rows)
            local = ids.remainder(self.local_rows) if self.wrap else ids - self.offset
            accumulate_rows(self.sums, local, rows.to(self.sums.dtype))
            self.received += 1
        return self.sums

    def arrived(self, scheduler) -> bool:
        """Whether every part not yet received is in (never blocks)."""
        return all(scheduler.ready(t) for part in self.parts[self.received:] for t in part)

    def reduced(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The received sums of `rows` (all by default), times the scale."""
        part = self.sums.clone() if rows is None else self.sums.index_select(0, rows)
        return part.mul_(self.scale) if self.scale != 1.0 else part


@dataclass
class Missed:
    """A table's optimizer step that came while its rows were on the wire, applied by rows."""

    hyperparameters: list[dict]
    earlier: torch.Tensor | None  # the table's .grad at the step (gradient accumulated before)
    exchanges: list[Exchange]
    before: dict | None = None  # the optimizer state before the step (row_step.state_before), at the first rows
    stepped: torch.Tensor | None = None  # per local row, whether it is stepped (None: no row yet)

    def gradient(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The table gradient of `rows` (all by default): each exchange's sums scaled, summed
        in their order, added to the earlier gradient (every part `rows` need received)."""
        total = None
        for exchange in self.exchanges:
            part = exchange.reduced(rows)
            total = part if total is None else total.add_(part)
        if self.earlier is None:
            return total
        return (self.earlier if rows is None else self.earlier.index_select(0, rows)).add(total)

    def first_rows(self) -> torch.Tensor | None:
        """The rows every exchange's first part brings all gradients of (None: every row)."""
        first = None
        for exchange in self.exchanges:
            if exchange.first is not None:
                first = exchange.first if first is None else first[torch.isin(first, exchange.first)]
        return first


@dataclass
class RowSchedule:
    scheduler: object  # CommScheduler
    params: dict[str, torch.nn.Parameter]  # table (weight name) -> its parameter
    graph: fx.GraphModule | None = None  # the captured program: where each table's ids come from
    optimizer: torch.optim.Optimizer | None = None
    by_rows: bool = True  # the optimizer's step can be applied by rows (row_step.splits_by_rows)
    next_rows: dict[str, torch.Tensor] = field(default_factory=dict)  # table -> sorted rows the next batch reads
    posted: dict[str, list[Exchange]] = field(default_factory=dict)  # exchanges no optimizer step has come for
    missed: dict[str, Missed] = field(default_factory=dict)  # table -> the step it missed, rows still to step
    caught_up: int = 0  # tables stepped after their optimizer step, so far
    # When a list: (what, table, perf_counter time, rows) as it happens: "lookup" (rows read),
    # "next" (rows the lookup stepped), "later" (the other rows, stepped once in), "whole".
    events: list[tuple[str, str, float, int]] | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Defer from now on: `optimizer`'s steps skip tables still on the wire; their rows
        are stepped as they are settled."""
        self.optimizer = optimizer
        self.by_rows = splits_by_rows(optimizer)
        self.scheduler.dispatcher.enforce_priority = True
        optimizer.register_step_pre_hook(self._before_step)
        name = type(optimizer).__name__
        if not self.by_rows and name not in _NOTED and self.scheduler.rank == 0:
            _NOTED.add(name)
            print(f"commfx: split_embedding_comm:schedule=2d steps a table's rows apart under SGD, Adam and AdamW only; "
                  f"under {name} each lookup waits for all its table's rows and steps the table whole", file=sys.stderr, flush=True)

    @property
    def deferring(self) -> bool:
        return self.optimizer is not None and not self.scheduler.local_only

    @property
    def pending(self) -> bool:
        return bool(self.posted) or bool(self.missed)

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
        self.poll()
        unique, summed = coalesce_rows(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), padding_idx)
        deferring = self.deferring and table in self.params
        known = gather_rows(self.scheduler, group, self.next_rows.pop(table, None), grad.device) if deferring else None
        exchange = start_exchange(self.scheduler, unique, summed, layout=layout, group=group, local_rows=local_rows,
                                  scale=scale, readers=known, tag=table)
        if not deferring:
            return reduce_exchanges([exchange], grad, self.scheduler)
        self.posted.setdefault(table, []).append(exchange)
        return grad.new_zeros((local_rows, grad.shape[-1]))

    # -- optimizer step and settling ---------------------------------------------------

    def _before_step(self, optimizer, args, kwargs) -> None:
        if catching_up(optimizer):
            return
        for table in list(self.missed):  # the step before is owed first (momentum and moments carry over)
            self._finish(table)
        if not self.posted:
            return
        hyperparameters = hyperparameters_of(optimizer)
        for table, exchanges in self.posted.items():
            param = self.params[table]
            self.missed[table] = Missed(hyperparameters, param.grad, exchanges)
            param.grad = None  # not in this step; its rows are stepped as they arrive
        self.posted = {}

    def before_lookup(self, table: str, reads: torch.Tensor) -> None:
        """Ahead of a lookup of `table` that reads its local rows `reads`: step the rows of
        its missed step the batch reads (waiting for the first part only), or every row if
        the lookup reads one outside them; gradients posted since its last step (gradient
        accumulation) are added into its .grad."""
        self._event("lookup", table, reads.numel())
        self.poll()
        missed = self.missed.get(table)
        if missed is not None:
            if missed.stepped is None and self.by_rows:
                self._step_first(table, missed)
            if missed.stepped is None or not bool(missed.stepped[reads.reshape(-1)].all()):
                self._finish(table)
        if table in self.posted:  # no optimizer step since: the gradient is the next step's
            param = self.params[table]
            reduced = reduce_exchanges(self.posted.pop(table), param, self.scheduler)
            param.grad = reduced if param.grad is None else param.grad.add_(reduced)

    def poll(self) -> None:
        """Step the remaining rows of every table whose rows the lookup stepped already and
        whose other rows have arrived (never waits)."""
        for table, missed in list(self.missed.items()):
            if missed.stepped is not None and all(e.arrived(self.scheduler) for e in missed.exchanges):
                self._finish(table)

    def settle(self, table: str | None = None) -> None:
        """Wait for `table`'s rows (every table by default) and step them, or, with no step
        missed, add them into its gradient for the next step."""
        for name in [table] if table is not None else list(self.missed):
            if name in self.missed:
                self._finish(name)
        for name in [table] if table is not None else list(self.posted):
            exchanges = self.posted.pop(name, None)
            if exchanges:
                param = self.params[name]
                reduced = reduce_exchanges(exchanges, param, self.scheduler)
                param.grad = reduced if param.grad is None else param.grad.add_(reduced)

    def _step_first(self, table: str, missed: Missed) -> None:
        """Receive the first part and step the rows it completes (the next batch's)."""
        first = missed.first_rows()
        if first is None:
            return  # every row is urgent: the table is stepped whole
        param = self.params[table]
        for exchange in missed.exchanges:
            exchange.receive(self.scheduler, param, 1)
        missed.before = state_before(self.optimizer, param)
        missed.stepped = torch.zeros(param.shape[0], dtype=torch.bool, device=param.device)
        self._step_rows(param, missed, first.to(param.device))
        self._event("next", table, first.numel())

    def _finish(self, table: str) -> None:
        """Wait for every part of `table`'s missed step and step the rows not stepped yet."""
        missed = self.missed.pop(table)
        param = self.params[table]
        for exchange in missed.exchanges:
            exchange.receive(self.scheduler, param, len(exchange.parts))
        if missed.stepped is None:
            param.grad = missed.gradient()
            step_only(self.optimizer, [param], missed.hyperparameters)
            param.grad = None
            self._event("whole", table, param.shape[0])
        else:
            rest = (~missed.stepped).nonzero().reshape(-1)
            self._step_rows(param, missed, rest)
            self._event("later", table, rest.numel())
        self.caught_up += 1

    def _step_rows(self, param: torch.nn.Parameter, missed: Missed, rows: torch.Tensor) -> None:
        step_rows(self.optimizer, param, rows, missed.gradient(rows), missed.hyperparameters, missed.before)
        missed.stepped[rows] = True

    def _event(self, what: str, table: str, rows: int) -> None:
        if self.events is not None:
            self.events.append((what, table, time.perf_counter(), rows))


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
    mine = reads[handle.rank]
    first = None if mine is None else mine[(mine >= offset) & (mine < offset + local_rows)] - offset
    return Exchange(received, local_rows, offset, scale, wrap=scheduler.local_only, first=first)


def reduce_exchanges(exchanges: list[Exchange], like: torch.Tensor, scheduler) -> torch.Tensor:
    """The table gradient: each exchange's rows added into zeros (urgent part, then the
    rest: every row's contributions arrive in one part, in rank order), scaled; several
    exchanges (backward passes before a step) summed in their order."""
    total = None
    for exchange in exchanges:
        exchange.receive(scheduler, like, len(exchange.parts))
        table = exchange.reduced()
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
