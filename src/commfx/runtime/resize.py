"""Shard widths as runtime state: ZERO-resizing and lossless migration of tp linears.

Each resizable tensor-parallel linear (`commfx.tp_linear`, placed by the resize_tp pass)
looks up its `LinearPlan` in the comm scheduler's `op_state` when it runs (none: a plain
linear):

- **Resizing** (ZERO-resizing, arXiv 2401.11469): a slow rank contracts over a kept subset
  S of its contraction dim, Y = X[..., S] W[:, S]^T (+ b); backward imputes zeros at the
  dropped positions of the input and weight gradients, so every tensor, and so every
  collective, keeps its shape. S is chosen by priority: the columns whose weights changed
  most since the last selection (the largest at the first). Lossy; the relative error of
  the dropped part is measured on a few rows of every forward (`LinearPlan.error`).
- **Unit resizing** (ZERO-resizing where blocks have units, as unit migration does): a slow
  rank computes only the first k units of its shard (heads, blocks of MLP columns) on views
  of their weights and activations, and nobody computes the rest: their rows of a column
  linear are zeros, their columns of the row linear are skipped, their gradients imputed
  zero, so no step gathers anything and no collective changes shape. The units kept are those
  whose weights changed most since the last selection (the largest at the first): the shard
  is permuted between steps to put them first (weights, gradients and optimizer state;
  permuting units within a shard leaves the block's function unchanged), and put back in
  order at full width (`Resizer.resize_units`). Column resizing gathers X[..., S] and W[:, S]
  every forward and scatters both gradients every backward, which on this CPU cost about
  what the dropped columns saved (benchmarks/RESULTS.md, issue 14).
- **Unit migration** (what SEMI and `mode=migrate` use by default, `resize_tp:migrate=units`):
  a slow rank (giver) hands whole units of a block -- attention heads, or blocks of MLP
  intermediate columns: a unit's column-parallel weight rows (and bias) together with the
  matching row-parallel weight columns -- to a faster rank (taker). The taker computes them
  end to end from the block's replicated input (the tensor_parallel pass's unit function:
  the block's own ops planned for one unit), so it never waits on the giver, and adds their
  partial product to its own before the row-parallel all-reduce (`commfx.tp_units`): every
  collective keeps its shape. The giver skips those output rows and contraction columns.
  The units' weights, and each optimizer state tensor shaped like them (Adam's moments,
  momentum: elementwise optimizers), move once per decision, between steps, into the
  taker's slot parameters (`UnitSlots`, part of the module's parameters and state_dict),
  and back on recovery. No per-step traffic. Lossless: the same products, summed in another
  order; AdamW steps on a slot are the steps the giver would have taken (its state moved
  with it; `attach_optimizer` hands the runtime the optimizer, else moved units restart
  their optimizer state). Only where the tp group is the whole data-parallel replica (dp = 1,
  no pipeline): each tp group decides on its own, so dp replicas could disagree on layouts.
- **Column migration** (`resize_tp:migrate=columns`, the first design, kept for dp > 1): a
  slow rank hands some contraction columns of its row-parallel linears to a faster rank
  every step: it sends X[..., M] and W[:, M], the taker adds X_M W_M^T to its own partial
  product and returns dX_M and dW_M in backward. Lossless, but X_M comes from the straggler
  itself, so the taker waits on it: measured slower than doing nothing (RESULTS.md).

`Resizer` owns the plans of one module on this rank. Every rank of a tp group applies the
same decisions (see `semi.py`), so a migration's sends and receives pair up.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..plan import DEFAULT_CLASS
from .comm import CommScheduler, current_scheduler

KIND = "tp_migrate"  # what the comm stats call migration traffic


def state_key(key: str) -> str:
    return f"tp_linear:{key}"


def units_key(key: str) -> str:
    return f"tp_units:{key}"


@dataclass(frozen=True)
class Migration:
    giver: int  # tp index whose columns move
    taker: int  # tp index that computes them
    columns: tuple[int, ...]  # the giver's local contraction columns


@dataclass
class LinearPlan:
    """What one tp linear computes on this rank this step."""

    key: str
    kind: str  # "column" | "row"
    width: int  # contraction width of this rank's shard
    tp_rank: int
    kept: list[int] | None = None  # resizing: the columns kept (None: all of them)
    migration: Migration | None = None
    sample_rows: int = 8  # rows on which the resizing error is measured
    error: float = 0.0  # relative error of the dropped columns in the last forward
    rows: int = 0  # rows (tokens) of the last forward
    stash: list = field(default_factory=list, repr=False)  # the taker's migrated columns, forward -> backward
    skip_rows: tuple[int, ...] = ()  # unit migration, giver: output rows (a column linear's) another rank computes
    skip_columns: tuple[int, ...] = ()  # unit migration, giver: contraction columns (a row linear's) another rank computes
    cut: tuple[int, int, int, int] | None = None  # ... the same as (outer, heads/columns, inner, kept): the first kept of each outer part
    dropped: int = 0  # unit resizing: heads/columns per outer part after the kept ones that nobody computes (imputed zero)
    out_width: int = 0  # output rows of the weight
    _index: torch.Tensor | None = field(default=None, repr=False)
    _rows: torch.Tensor | None = field(default=None, repr=False)

    def is_plain(self) -> bool:
        return self.kept is None and self.migration is None and not self.skip_rows and not self.skip_columns

    def given(self) -> bool:
        return self.migration is not None and self.migration.giver == self.tp_rank

    def taken(self) -> bool:
        return self.migration is not None and self.migration.taker == self.tp_rank

    def compute_index(self) -> torch.Tensor | None:
        """The columns this rank multiplies itself: the kept ones, less those it gives away
        (None: every column)."""
        if self._index is None:
            columns = set(range(self.width) if self.kept is None else self.kept)
            if self.given():
                columns -= set(self.migration.columns)
            columns -= set(self.skip_columns)
            self._index = torch.tensor(sorted(columns), dtype=torch.long)
        return None if self._index.numel() == self.width else self._index

    def row_index(self) -> torch.Tensor | None:
        """The output rows this rank computes (None: every row); the others are zeros."""
        if not self.skip_rows:
            return None
        if self._rows is None:
            self._rows = torch.tensor(sorted(set(range(self.out_width)) - set(self.skip_rows)), dtype=torch.long)
        return self._rows

    def changed(self) -> None:
        self._index = self._rows = None


# ------------------------------------------------------------------- the op's two halves


def _plan(key: str) -> tuple[LinearPlan | None, CommScheduler]:
    scheduler = current_scheduler()
    return scheduler.op_state.get(state_key(key)), scheduler


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str, group: str) -> torch.Tensor:
    plan, scheduler = _plan(key)
    if plan is None or plan.is_plain():
        return F.linear(x, weight, bias)
    if plan.cut is not None and plan.kept is None and plan.migration is None:
        return _cut_forward(plan, x, weight, bias)
    index, rows = plan.compute_index(), plan.row_index()
    xs = x if index is None else x.index_select(-1, index)
    w = weight if index is None else weight.index_select(1, index)
    if rows is None:
        y = F.linear(xs, w, bias)
    else:  # unit migration: the rows of the given units are another rank's (zeros here)
        part = F.linear(xs, w.index_select(0, rows), None if bias is None else bias.index_select(0, rows))
        y = x.new_zeros((*x.shape[:-1], weight.shape[0])).index_copy_(-1, rows, part)
    plan.rows = x.numel() // max(x.shape[-1], 1)
    if plan.migration is not None:
        columns = torch.tensor(plan.migration.columns, dtype=torch.long)
        if plan.given():
            _send(scheduler, group, plan.migration.taker, x.index_select(-1, columns), weight.index_select(1, columns))
        elif plan.taken():
            count = len(plan.migration.columns)
            x_m, w_m = _recv(scheduler, group, plan.migration.giver, x.new_empty((*x.shape[:-1], count)), weight.new_empty((weight.shape[0], count)))
            plan.stash.append((x_m, w_m))
            y = y + F.linear(x_m, w_m)
    if plan.kept is not None:
        plan.error = _dropped_error(plan, x, weight, bias, y)
    return y


def linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, key: str, group: str):
    plan, scheduler = _plan(key)
    out, width = weight.shape
    g2 = grad.reshape(-1, out)
    x2 = x.reshape(-1, width)
    bias_grad = g2.sum(0) if has_bias else weight.new_empty((0,))
    if plan is None or plan.is_plain():
        return grad.matmul(weight), g2.t().matmul(x2), bias_grad
    if plan.cut is not None and plan.kept is None and plan.migration is None:
        return _cut_backward(plan, grad, x, weight, has_bias)
    index, rows = plan.compute_index(), plan.row_index()
    if rows is not None:  # given units' rows: another rank back-propagates them
        grad, g2, w_rows = grad.index_select(-1, rows), g2.index_select(1, rows), weight.index_select(0, rows)
        if has_bias:
            bias_grad = weight.new_zeros((out,)).index_copy_(0, rows, g2.sum(0))
    else:
        w_rows = weight
    if index is None:
        grad_x = grad.matmul(w_rows)
        part = g2.t().matmul(x2)
    else:  # dropped (or given away) columns: imputed zero
        grad_x = x.new_zeros(x.shape).index_copy_(-1, index, grad.matmul(w_rows.index_select(1, index)))
        part = g2.t().matmul(x2.index_select(1, index))
    if rows is None and index is None:
        grad_w = part
    elif rows is None:
        grad_w = weight.new_zeros(weight.shape).index_copy_(1, index, part)
    elif index is None:
        grad_w = weight.new_zeros(weight.shape).index_copy_(0, rows, part)
    else:
        grad_w = weight.new_zeros(weight.shape)
        grad_w.index_copy_(0, rows, weight.new_zeros((rows.numel(), weight.shape[1])).index_copy_(1, index, part))
    if plan.given():
        columns = torch.tensor(plan.migration.columns, dtype=torch.long)
        gx_m, gw_m = _recv(scheduler, group, plan.migration.taker, x.new_empty((*x.shape[:-1], len(columns))), weight.new_empty((out, len(columns))))
        grad_x[..., columns] = gx_m
        grad_w[:, columns] = gw_m
    elif plan.taken():
        x_m, w_m = plan.stash.pop()
        _send(scheduler, group, plan.migration.giver, grad.matmul(w_m), g2.t().matmul(x_m.reshape(-1, x_m.shape[-1])))
    return grad_x, grad_w, bias_grad


def _cut(t: torch.Tensor, dim: int, plan: LinearPlan) -> torch.Tensor:
    """The kept heads/columns of `t` along `dim` (a view: outer x kept x inner of outer x per x inner)."""
    outer, per, inner, kept = plan.cut
    dim = dim % t.dim()
    return t.unflatten(dim, (outer, per, inner)).narrow(dim + 1, 0, kept)


def _kept(t: torch.Tensor, dim: int, plan: LinearPlan) -> torch.Tensor:
    """The kept heads/columns of a 2-d `t` along `dim`: a view where they are one range (one
    outer part: MLP columns, a row-parallel linear's), else a copy."""
    outer, per, inner, kept = plan.cut
    if outer == 1:
        return t.narrow(dim, 0, kept * inner)
    return _cut(t, dim, plan).flatten(dim, dim + 2)


def _put(t: torch.Tensor, dim: int, plan: LinearPlan, value: torch.Tensor) -> torch.Tensor:
    """Write `value` (the kept heads/columns) into a 2-d `t` along `dim`; returns `t`."""
    outer, per, inner, kept = plan.cut
    if outer == 1:
        t.narrow(dim, 0, kept * inner).copy_(value)
    else:
        _cut(t, dim, plan).copy_(value.unflatten(dim, (outer, kept, inner)))
    return t


def _cut_forward(plan: LinearPlan, x, weight, bias):
    """A giver's linear with its last units given away, in 2-d on views of the kept units
    (one range for MLP columns and row-parallel linears): no index copies."""
    out, width = weight.shape
    x2 = x.reshape(-1, width)
    plan.rows = x2.shape[0]
    if plan.kind == "row":  # contraction columns
        y2 = F.linear(_kept(x2, 1, plan), _kept(weight, 1, plan), bias)
    else:
        part = F.linear(x2, _kept(weight, 0, plan), None if bias is None else _kept(bias.unsqueeze(1), 0, plan).squeeze(1))
        y2 = _put(x2.new_zeros((x2.shape[0], out)), 1, plan, part)
        if plan.dropped:
            plan.error = _dropped_units_error(plan, x2, weight)
    return y2.view(*x.shape[:-1], out)


def _dropped_units_error(plan: LinearPlan, x2, weight) -> float:
    """Unit resizing: |X W_D^T| / |X W_C^T| on the first few rows, D the dropped units' rows
    and C those this rank is responsible for (kept and dropped, not given away): the share of
    the block's activations that resizing left out."""
    outer, per, inner, kept = plan.cut
    with torch.no_grad():
        full = (x2[: plan.sample_rows] @ weight.t()).unflatten(1, (outer, per, inner))
        dropped = full.narrow(2, kept, plan.dropped).norm()
        return float(dropped / full.narrow(2, 0, kept + plan.dropped).norm().clamp_min(1e-30))


def _cut_backward(plan: LinearPlan, grad, x, weight, has_bias):
    out, width = weight.shape
    x2, g2 = x.reshape(-1, width), grad.reshape(-1, out)
    if plan.kind == "row":
        grad_x = _put(x2.new_zeros(x2.shape), 1, plan, g2.matmul(_kept(weight, 1, plan)))
        grad_w = _put(weight.new_zeros(weight.shape), 1, plan, g2.t().matmul(_kept(x2, 1, plan)))
        bias_grad = g2.sum(0) if has_bias else weight.new_empty((0,))
        return grad_x.view(x.shape), grad_w, bias_grad
    gk = _kept(g2, 1, plan)  # the kept rows' output gradient
    grad_x = gk.matmul(_kept(weight, 0, plan))
    grad_w = _put(weight.new_zeros(weight.shape), 0, plan, gk.t().matmul(x2))
    bias_grad = weight.new_empty((0,))
    if has_bias:
        bias_grad = _put(weight.new_zeros((out, 1)), 0, plan, gk.sum(0).unsqueeze(1)).squeeze(1)
    return grad_x.view(x.shape), grad_w, bias_grad


# ---------------------------------------------------------------------- unit migration


class UnitSlots(torch.nn.Module):
    """The units a rank computes for another: one parameter per moved weight, sized by the
    current migration (empty when it takes none). Loading takes the saved sizes."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, param in self._parameters.items():
            saved = state_dict.get(prefix + name)
            if saved is not None and saved.shape != param.shape:
                param.data = param.data.new_empty(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


@dataclass
class UnitBlock:
    """One tp block whose units can move: its unit function (the tensor_parallel pass's), the
    weights a unit spans and, on a taker, the slot parameters holding the units it computes.

    `tensors[i]` = (weight, dim, layout): the unit's rows (dim 0: a column linear's weight
    and bias) or columns (dim 1: the row linear's weight), cut by this rank's layout
    (outer, units per rank, inner). A unit function takes the weights in this order."""

    key: str  # the row linear's weight (the block's name in plans and state)
    graph: fx.GraphModule
    kinds: str  # per outside input of the unit function: "t" a tensor, "s" a size
    tensors: list[tuple[str, int, list[int]]]
    per_rank: int  # parts per rank (a part: a head, a kv group, an MLP column)
    unit: int  # parts per unit
    slots: list[torch.nn.Parameter] = field(default_factory=list, repr=False)
    taken: int = 0  # units this rank computes for another (in its slots)
    stash: list = field(default_factory=list, repr=False)  # forward -> backward: the vjp of the taken units

    @property
    def units(self) -> int:
        return self.per_rank // self.unit

    def index(self, layout: list[int], first: int, count: int) -> torch.Tensor:
        """Indices, along a weight's dim, of units first..first+count-1 of this rank's shard, in
        the order the unit function takes them (outer x heads/columns x inner); a unit spans
        per / units of this weight's heads (under grouped-query attention a q weight's unit
        has more heads than a k/v weight's)."""
        return self.order_index(layout, range(first, first + count))

    def order_index(self, layout: list[int], order) -> torch.Tensor:
        """Indices, along a weight's dim, that put the units of this rank's shard in `order`
        (position i takes unit order[i]) within each outer part (q, k, v of a fused weight)."""
        outer, per, inner = layout
        size = per // self.units
        parts = torch.tensor([u * size + j for u in order for j in range(size)], dtype=torch.long)
        return torch.arange(outer * per * inner).view(outer, per, inner)[:, parts, :].reshape(-1)


def units_forward(partial: torch.Tensor, tensors: list[torch.Tensor], sizes: list[int], key: str, group: str) -> torch.Tensor:
    """The row-parallel partial product plus, on a taker, the partial products of the units it
    computes for another rank: the unit function on the block's replicated inputs and the
    slots (every unit taken, in one call)."""
    block = current_scheduler().op_state.get(units_key(key))
    if block is None or not block.taken:
        return partial.clone()
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point()]

    def units(float_inputs, weights):
        swapped = list(tensors)
        for i, t in zip(floating, float_inputs):
            swapped[i] = t
        t_iter, s_iter = iter(swapped), iter(sizes)
        inputs = [next(t_iter) if kind == "t" else next(s_iter) for kind in block.kinds]
        return block.graph(block.taken * block.unit, *inputs, *weights)  # every unit taken, in one call

    with _autograd_inside_op():
        float_inputs = [tensors[i].detach().requires_grad_() for i in floating]
        weights = [p.detach().requires_grad_() for p in block.slots]
        out = units(float_inputs, weights)
    block.stash.append((float_inputs, weights, out))
    del block.stash[:-STASH]  # forwards without a backward (evaluation) leave nothing behind
    return partial + out.detach()


STASH = 4
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor)


@contextmanager
def _autograd_inside_op():
    """Autograd back on inside a custom op's implementation, which runs below it (its dispatch
    keys excluded): a taker records its units' own graph in forward and differentiates it in
    backward. (torch.func.vjp works there too, at about 1.5x the cost on CPU.)"""
    old = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    try:
        for k in _AUTOGRAD_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(_AUTOGRAD_KEYS, old):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def units_backward(grad: torch.Tensor, tensors: list[torch.Tensor], key: str, group: str) -> list[torch.Tensor]:
    """Gradients for the units' inputs (zero on a rank that computes none); the slots'
    gradients are accumulated into their `.grad` (they are not graph inputs)."""
    block = current_scheduler().op_state.get(units_key(key))
    grads = [t.new_zeros(t.shape) for t in tensors]
    if block is None or not block.taken or not block.stash:
        return grads
    float_inputs, weights, out = block.stash.pop()
    with _autograd_inside_op():
        found = torch.autograd.grad(out, [*float_inputs, *weights], grad, allow_unused=True)
    for i, g in zip([i for i, t in enumerate(tensors) if t.is_floating_point()], found[: len(float_inputs)]):
        if g is not None:
            grads[i] = g
    for slot, g in zip(block.slots, found[len(float_inputs) :]):
        if g is not None:
            slot.grad = g if slot.grad is None else slot.grad + g
    return grads


def _send(scheduler: CommScheduler, group: str, peer: int, *tensors: torch.Tensor) -> None:
    # The default lane, where the tp all-reduces go: one lane per group keeps gloo's order.
    pending = [scheduler.start_send(t.contiguous(), group, peer, kind=KIND, priority=DEFAULT_CLASS, lane="") for t in tensors]
    for p in pending:
        scheduler.wait(p)


def _recv(scheduler: CommScheduler, group: str, peer: int, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    pending = [scheduler.start_recv(b, group, peer, kind=KIND, priority=DEFAULT_CLASS, lane="") for b in buffers]
    for p in pending:
        scheduler.wait(p)
    return buffers


def _dropped_error(plan: LinearPlan, x, weight, bias, y) -> float:
    """|X_D W_D^T| / |X W^T| on the first few rows: what resizing left out of this output
    (the full product of those rows less the kept one: no gather of the dropped columns)."""
    with torch.no_grad():
        rows = x.reshape(-1, plan.width)[: plan.sample_rows]
        full = rows @ weight.t()
        kept = y.reshape(-1, weight.shape[0])[: rows.shape[0]] - (bias if bias is not None else 0)
        if plan.given():  # columns another rank computes are not dropped
            columns = torch.tensor(plan.migration.columns, dtype=torch.long)
            kept = kept + rows.index_select(1, columns) @ weight.index_select(1, columns).t()
        if plan.row_index() is not None:  # ... nor the rows of units it computes
            full, kept = full.index_select(1, plan.row_index()), kept.index_select(1, plan.row_index())
        return float((full - kept).norm() / full.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- the plans


def priority_columns(weight: torch.Tensor, snapshot: torch.Tensor | None, keep: int) -> list[int]:
    """The `keep` contraction columns whose weights changed most since `snapshot` (the
    largest columns when there is none); ties go to the lower index."""
    change = weight if snapshot is None else weight - snapshot
    score = change.detach().double().norm(dim=0)
    order = sorted(range(score.numel()), key=lambda j: (-float(score[j]), j))
    return sorted(order[:keep])


def _check_unit_fraction(fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a resize fraction must be in (0, 1] (the share of units a rank keeps), got {fraction}")


class Resizer:
    """The resizable linears of one module on this rank and their current plans.

    `linears`: key -> (weight parameter, "column" | "row"); the contraction dim is dim 1.
    `units`: the blocks whose units can move (unit migration), keyed by their row linear;
    moving them is collective over `group` through `scheduler`.
    """

    def __init__(self, linears: dict[str, tuple[torch.Tensor, str]], op_state: dict, tp_rank: int, tp_size: int,
                 units: dict[str, UnitBlock] | None = None, params: dict[str, torch.nn.Parameter] | None = None,
                 scheduler=None, group: str = "tp"):
        self.linears = linears
        self.op_state = op_state
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.fraction = 1.0  # kept fraction on this rank (1: full width)
        self.migration: dict | None = None  # {"giver", "taker", "fraction"} in tp indices
        self.snapshots: dict[str, torch.Tensor] = {}  # weights at the last selection
        for key, (weight, kind) in linears.items():
            op_state[state_key(key)] = LinearPlan(key, kind, weight.shape[1], tp_rank, out_width=weight.shape[0])
        self.units = units or {}
        self.params = params or {}  # name -> parameter, for every weight and bias a unit spans
        self.scheduler, self.group = scheduler, group
        self.optimizer: torch.optim.Optimizer | None = None  # its state moves with the units (attach_optimizer)
        self.unit_migration: dict | None = None  # {"giver", "taker", "counts": {block: units}} in force
        self.pending: dict | None = None  # ... requested, moved at the next step's start
        self.moved_bytes = 0  # bytes the last move sent (weights and optimizer state)
        # Unit resizing (ZERO-resizing by whole units, where blocks have units): this rank
        # computes only the first `unit_kept[block]` units of its shard; the units are ordered
        # by priority first (the shard permuted between steps, see `_order_units`).
        self.unit_kept: dict[str, int] | None = None
        self.unit_fraction = 1.0  # the kept fraction asked for (of the units not given away)
        self.pending_fraction: float | None = None  # ... requested, applied at the next step's start
        self.unit_snapshots: dict[str, list[torch.Tensor]] = {}  # each block's weights at the last selection
        self.unit_order: dict[str, list[int]] = {}  # per block, the unit at each position of the shard (absent: in order)
        self.slots = UnitSlots()
        for key, block in self.units.items():
            op_state[units_key(key)] = block
            block.slots = []
            for i, (name, dim, _layout) in enumerate(block.tensors):
                shape = list(self.params[name].shape)
                shape[dim] = 0
                slot = torch.nn.Parameter(self.params[name].detach().new_empty(shape))
                self.slots.register_parameter(f"{key.replace('.', '_')}__{i}", slot)
                block.slots.append(slot)

    def plan(self, key: str) -> LinearPlan:
        return self.op_state[state_key(key)]

    def resize(self, fraction: float, kept: dict[str, list[int]] | None = None) -> None:
        """Keep `fraction` of this rank's contraction columns, chosen by priority (1.0: full
        width again); `kept` names the columns instead (tests: every column)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"a resize fraction must be in (0, 1] (the share of columns a rank keeps), got {fraction}")
        self.fraction = fraction
        for key, (weight, _kind) in self.linears.items():
            plan = self.plan(key)
            if kept is not None:
                plan.kept = sorted(kept[key])
            elif fraction >= 1.0:
                plan.kept = None
            else:
                plan.kept = priority_columns(weight, self.snapshots.get(key), max(1, math.ceil(fraction * plan.width)))
                self.snapshots[key] = weight.detach().clone()
            if plan.kept is None:
                plan.error = 0.0
            plan.changed()

    def migrate(self, giver: int, taker: int, fraction: float) -> None:
        """Hand `fraction` of the giver's row-parallel contraction columns (its last ones) to
        the taker, both tp indices; fraction 0 undoes it."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"a migration fraction must be in [0, 1), got {fraction}")
        if fraction > 0 and (giver == taker or not (0 <= giver < self.tp_size and 0 <= taker < self.tp_size)):
            raise ValueError(f"migration needs two different tp ranks in [0, {self.tp_size}), got giver {giver}, taker {taker}")
        self.migration = {"giver": giver, "taker": taker, "fraction": fraction} if fraction > 0 else None
        for key, (_weight, kind) in self.linears.items():
            plan = self.plan(key)
            count = int(round(fraction * plan.width)) if kind == "row" else 0
            plan.migration = Migration(giver, taker, tuple(range(plan.width - count, plan.width))) if count else None
            plan.stash.clear()
            plan.changed()

    def restore(self) -> None:
        """Full width and no migration: plain tensor parallelism (moved units come back at the
        next step's start, `apply_pending`)."""
        self.resize(1.0)
        self.migrate(0, 0, 0.0)
        if self.unit_migration is not None or self.pending is not None:
            self.request_units(0, 0, {})
        if self.unit_kept is not None or self.pending_fraction is not None or self.unit_order:
            self.request_unit_resize(1.0)  # ... and the units back in their own order

    # -- unit migration ---------------------------------------------------------------

    def unit_counts(self, fraction: float) -> dict[str, int]:
        """Units per block that move for `fraction` of a rank's share (rounded per block)."""
        return {key: min(block.units - 1, int(round(fraction * block.units))) for key, block in self.units.items()}

    def moved_share(self, counts: dict[str, int]) -> float:
        """The share of a rank's tp multiply-adds that `counts` moves (blocks weighted by weight size)."""
        total = sum(w.numel() for w, _ in self.linears.values())
        moved = 0.0
        for key, block in self.units.items():
            size = sum(self.params[name].numel() for name, dim, _ in block.tensors if name in self.linears)
            moved += size * counts.get(key, 0) / block.units
        return moved / total if total else 0.0

    def request_units(self, giver: int, taker: int, counts: dict[str, int]) -> None:
        """Ask for `counts` units of each block of the giver to be computed by the taker (empty:
        none), moved by the next `apply_pending` (the controller calls it at a step's start)."""
        counts = {k: int(n) for k, n in counts.items() if n}
        self.pending = {"giver": giver, "taker": taker, "counts": counts} if counts else {"giver": 0, "taker": 0, "counts": {}}

    def apply_pending(self) -> int:
        """Move what `request_units` asked for (collective: every rank of the tp group calls it
        at the same point, between steps). Returns the bytes moved."""
        moved = 0
        if self.pending is not None:
            pending, self.pending = self.pending, None
            moved = self.move_units(pending["giver"], pending["taker"], pending["counts"])
            if self.unit_kept is not None and self.pending_fraction is None:
                self.pending_fraction = self.unit_fraction  # other units given away: choose the kept ones anew
        if self.pending_fraction is not None:
            fraction, self.pending_fraction = self.pending_fraction, None
            self.resize_units(fraction)
        return moved

    # -- unit resizing ------------------------------------------------------------------

    def request_unit_resize(self, fraction: float) -> None:
        """Ask for this rank to keep `fraction` of its units (those not given away; 1.0: all),
        applied by the next `apply_pending`, between steps: choosing the units reorders the
        shard, which must not happen between a backward and its optimizer step."""
        _check_unit_fraction(fraction)
        self.pending_fraction = fraction

    def given_units(self, key: str) -> int:
        migration = self.unit_migration
        return migration["counts"].get(key, 0) if migration and migration["giver"] == self.tp_rank else 0

    def resize_units(self, fraction: float) -> None:
        """Keep `fraction` of each block's units that this rank computes itself (ZERO-resizing
        by whole heads and MLP column blocks): the units whose weights changed most since the
        last selection (the largest at the first) are moved to the front of the shard, and the
        linears compute on views of them, so no step gathers anything. Local: permuting units
        within a shard changes no other rank's work (the row-parallel sum runs over them)."""
        _check_unit_fraction(fraction)
        self.unit_fraction = fraction
        if fraction >= 1.0:  # every unit computed again, back in their own order where not given away
            self.unit_kept = None
            self.unit_snapshots = {}
            for key, block in self.units.items():
                current, available = self.unit_order.get(key, list(range(block.units))), block.units - self.given_units(key)
                self._permute(key, block, sorted(range(available), key=lambda p: current[p]) + list(range(available, block.units)))
        else:
            self.unit_kept = {}
            for key, block in self.units.items():
                available = block.units - self.given_units(key)
                keep = min(available, max(1, math.ceil(fraction * available - 1e-9)))
                self._order_units(key, block, available, keep)
                self.unit_kept[key] = keep
        self._set_unit_plans()

    def _order_units(self, key: str, block: UnitBlock, available: int, keep: int) -> None:
        """Put the `keep` units (of the first `available`) whose weights changed most since the
        last selection first, in their current order, by permuting the shard's weights, their
        gradients and their optimizer state along the unit axis; then snapshot the weights."""
        tensors = [self.params[name] for name, _dim, _layout in block.tensors]
        snapshot = self.unit_snapshots.get(key)
        scores = []
        for u in range(available):
            score = 0.0
            for i, (param, (_name, dim, layout)) in enumerate(zip(tensors, block.tensors)):
                index = block.index(layout, u, 1)
                change = param.detach().index_select(dim, index)
                if snapshot is not None:
                    change = change - snapshot[i].index_select(dim, index)
                score += float(change.double().pow(2).sum())
            scores.append(score)
        ranked = sorted(range(available), key=lambda u: (-scores[u], u))
        kept = sorted(ranked[:keep])
        self._permute(key, block, kept + [u for u in range(available) if u not in kept] + list(range(available, block.units)))
        self.unit_snapshots[key] = [param.detach().clone() for param in tensors]

    def _permute(self, key: str, block: UnitBlock, order: list[int]) -> None:
        """Reorder the units of this rank's shard of `block`: position i takes the unit at
        position order[i], in every weight of the block, its gradient and its optimizer state
        (exact copies; the block computes the same function, its row-parallel sum in another
        order). `unit_order` remembers where each unit is, so full width puts them back."""
        if order == list(range(block.units)):
            return
        for name, dim, layout in block.tensors:
            param = self.params[name]
            index = block.order_index(layout, order)
            state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
            for tensor in [param.data, param.grad, *(v for v in state.values() if isinstance(v, torch.Tensor))]:
                if tensor is not None and tensor.shape == param.shape:
                    tensor.copy_(tensor.index_select(dim, index))
        current = self.unit_order.get(key, list(range(block.units)))
        self.unit_order[key] = [current[p] for p in order]
        if self.unit_order[key] == list(range(block.units)):
            del self.unit_order[key]

    def kept_share(self) -> float:
        """The share of this rank's tp multiply-adds it computes itself (1: all of them)."""
        if self.unit_kept is None:
            return self.fraction
        dropped = {key: block.units - self.given_units(key) - self.unit_kept.get(key, block.units) for key, block in self.units.items()}
        return 1.0 - self.moved_share(dropped)

    def move_units(self, giver: int, taker: int, counts: dict[str, int]) -> int:
        """Have the taker compute the giver's last `counts[block]` units of each block, from now
        on (collective over the tp group, between steps): the current migration's units move
        back first, then the new ones move, weights and optimizer state. {}: none moved."""
        counts = {k: int(n) for k, n in counts.items() if n}
        new = {"giver": giver, "taker": taker, "counts": counts} if counts else None
        if new is not None:
            if giver == taker or not (0 <= giver < self.tp_size and 0 <= taker < self.tp_size):
                raise ValueError(f"unit migration needs two different tp ranks in [0, {self.tp_size}), got giver {giver}, taker {taker}")
            for key, n in counts.items():
                if key not in self.units or not 0 < n < self.units[key].units + 1:
                    raise ValueError(f"block {key} cannot move {n} units (it has {self.units.get(key) and self.units[key].units} per rank)")
        if new == self.unit_migration:
            return 0
        moved = 0
        if self.unit_migration is not None:
            moved += self._transfer(self.unit_migration, back=True)
        if new is not None:
            moved += self._transfer(new, back=False)
        self.unit_migration = new
        self._set_unit_plans()
        self.moved_bytes = moved
        return moved

    def _state_names(self, param: torch.Tensor) -> list[str]:
        state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape)

    def _transfer(self, migration: dict, back: bool) -> int:
        """Move the units of `migration` from the giver's shard to the taker's slots (or back,
        `back`): each rank puts what it sends into a zero buffer and the group sums it (exact:
        x + 0 == x), in block order, weight then its optimizer state, on every rank alike."""
        giver, taker, me = migration["giver"], migration["taker"], self.tp_rank
        if self.optimizer is not None and not back:
            optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            missing = [key for key, block in self.units.items() if any(id(slot) not in optimized for slot in block.slots)]
            if missing:
                raise ValueError(
                    "the attached optimizer does not hold resize_tp's unit slots (module.tp_slots), so units moved to "
                    "a faster rank would not train: build it over the distributed module's parameters(), not .module's"
                )
        moved = 0
        for key in sorted(migration["counts"]):
            block, count = self.units[key], migration["counts"][key]
            for (name, dim, layout), slot in zip(block.tensors, block.slots):
                param = self.params[name]
                index = block.index(layout, block.units - count, count)
                shape = list(param.shape)
                shape[dim] = index.numel()
                names = self._state_names(param)
                param_state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
                slot_state = self.optimizer.state.get(slot, {}) if self.optimizer is not None else {}
                for j, what in enumerate([None, *names]):
                    source = param.data if what is None else param_state[what]
                    buffer = param.data.new_zeros(shape) if what is None else source.new_zeros(shape)
                    if not back and me == giver:
                        buffer.copy_(source.index_select(dim, index))
                    if back and me == taker:
                        buffer.copy_(slot.data if what is None else slot_state[what])
                    self.scheduler.all_reduce(buffer, self.group, kind="tp_unit_move")
                    moved += buffer.numel() * buffer.element_size()
                    if back and me == giver:
                        source.index_copy_(dim, index, buffer)
                    if not back and me == taker:
                        if what is None:
                            slot.data = buffer
                        else:
                            self.optimizer.state[slot][what] = buffer
                if not back and me == taker and self.optimizer is not None and param in self.optimizer.state:
                    for what, value in param_state.items():  # the step count and other scalars: as the taker's own
                        if what not in names:
                            self.optimizer.state[slot][what] = value.clone() if isinstance(value, torch.Tensor) else value
                if back and me == taker:
                    empty = list(param.shape)
                    empty[dim] = 0
                    slot.data = param.data.new_empty(empty)
                    if self.optimizer is not None:
                        self.optimizer.state.pop(slot, None)
                slot.grad = None
        return moved

    def _set_unit_plans(self) -> None:
        """The giver skips its moved units' rows and columns; the taker computes them."""
        migration = self.unit_migration
        for key, block in self.units.items():
            count = migration["counts"].get(key, 0) if migration else 0
            block.taken = count if migration is not None and migration["taker"] == self.tp_rank else 0
            given = self.given_units(key)
            dropped = 0 if self.unit_kept is None else max(0, block.units - given - self.unit_kept[key])
            skipped = given + dropped  # the last units: given away, and before them those resizing drops
            block.stash.clear()
            for name, dim, layout in block.tensors:
                if name not in self.linears:
                    continue  # a bias: skipped with its weight's rows
                plan = self.plan(name)
                index = tuple(block.index(layout, block.units - skipped, skipped).tolist()) if skipped else ()
                if dim == 0:
                    plan.skip_rows = index
                else:
                    plan.skip_columns = index
                outer, per, inner = layout
                size = per // block.units
                plan.cut = (outer, per, inner, per - skipped * size) if skipped else None
                plan.dropped = dropped * size
                if not dropped:
                    plan.error = 0.0
                plan.changed()

    def error(self) -> float:
        """Largest relative error a resized linear made in the last forward (0 when none is)."""
        return max((self.plan(key).error for key in self.linears if self.plan(key).kept is not None or self.plan(key).dropped), default=0.0)

    def migration_bytes(self, element_size: int) -> int:
        """Bytes the current migration moves per step (forward: X_M and W_M; backward: their gradients)."""
        total = 0
        for key, (weight, _kind) in self.linears.items():
            plan = self.plan(key)
            if plan.migration is not None:
                total += 2 * len(plan.migration.columns) * (weight.shape[0] + plan.rows) * element_size
        return total

    def state_dict(self) -> dict:
        return {
            "fraction": self.fraction,
            "kept": {key: self.plan(key).kept for key in self.linears},
            "migration": self.migration,
            "snapshots": {key: t.clone() for key, t in self.snapshots.items()},
            "unit_migration": self.unit_migration,
            "pending": self.pending,
            "unit_kept": self.unit_kept,
            "unit_fraction": self.unit_fraction,
            "pending_fraction": self.pending_fraction,
            "unit_snapshots": {key: [t.clone() for t in ts] for key, ts in self.unit_snapshots.items()},
            "unit_order": {key: list(order) for key, order in self.unit_order.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.fraction = state["fraction"]
        for key, kept in state["kept"].items():
            self.plan(key).kept = kept
            self.plan(key).changed()
        self.snapshots = {key: t.clone() for key, t in state.get("snapshots", {}).items()}
        migration = state.get("migration")
        self.migrate(migration["giver"], migration["taker"], migration["fraction"]) if migration else self.migrate(0, 0, 0.0)
        # Which units are where: the slots and shards themselves are parameters, loaded with
        # the module's state_dict (UnitSlots takes the saved sizes); nothing moves here.
        self.unit_migration, self.pending = state.get("unit_migration"), state.get("pending")
        # the units' order is in the (loaded) parameters; which of them are kept is here
        self.unit_kept, self.unit_fraction = state.get("unit_kept"), state.get("unit_fraction", 1.0)
        self.pending_fraction = state.get("pending_fraction")
        self.unit_snapshots = {key: [t.clone() for t in ts] for key, ts in state.get("unit_snapshots", {}).items()}
        self.unit_order = {key: list(order) for key, order in state.get("unit_order", {}).items()}
        self._set_unit_plans()


__all__ = ["LinearPlan", "Migration", "Resizer", "UnitBlock", "UnitSlots", "linear_backward", "linear_forward", "priority_columns",
           "state_key", "units_backward", "units_forward", "units_key"]
