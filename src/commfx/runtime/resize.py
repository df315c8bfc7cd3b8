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
- **Migration**: a slow rank (giver) hands some contraction columns of its row-parallel
  linears to a faster rank of its tp group (taker) every step: it sends X[..., M] and
  W[:, M], the taker adds X_M W_M^T to its own partial product (the row-parallel all-reduce
  sums partial products anyway) and returns dX_M and dW_M in backward. Lossless: the same
  products, summed in another order. The weights and so their optimizer state stay with
  their owner (what moves each step is the columns, not their ownership).

`Resizer` owns the plans of one module on this rank. Every rank of a tp group applies the
same decisions (see `semi.py`), so a migration's sends and receives pair up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..plan import DEFAULT_CLASS
from .comm import CommScheduler, current_scheduler

KIND = "tp_migrate"  # what the comm stats call migration traffic


def state_key(key: str) -> str:
    return f"tp_linear:{key}"


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
    _index: torch.Tensor | None = field(default=None, repr=False)

    def is_plain(self) -> bool:
        return self.kept is None and self.migration is None

    def given(self) -> bool:
        return self.migration is not None and self.migration.giver == self.tp_rank

    def taken(self) -> bool:
        return self.migration is not None and self.migration.taker == self.tp_rank

    def compute_index(self) -> torch.Tensor:
        """The columns this rank multiplies itself: the kept ones, less those it gives away."""
        if self._index is None:
            columns = set(range(self.width) if self.kept is None else self.kept)
            if self.given():
                columns -= set(self.migration.columns)
            self._index = torch.tensor(sorted(columns), dtype=torch.long)
        return self._index

    def changed(self) -> None:
        self._index = None


# ------------------------------------------------------------------- the op's two halves


def _plan(key: str) -> tuple[LinearPlan | None, CommScheduler]:
    scheduler = current_scheduler()
    return scheduler.op_state.get(state_key(key)), scheduler


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str, group: str) -> torch.Tensor:
    plan, scheduler = _plan(key)
    if plan is None or plan.is_plain():
        return F.linear(x, weight, bias)
    index = plan.compute_index()
    y = F.linear(x.index_select(-1, index), weight.index_select(1, index), bias)
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
    index = plan.compute_index()
    grad_x = x.new_zeros(x.shape)  # dropped (or given away) columns: imputed zero
    grad_w = weight.new_zeros(weight.shape)
    grad_x[..., index] = grad.matmul(weight.index_select(1, index))
    grad_w[:, index] = g2.t().matmul(x2.index_select(1, index))
    if plan.given():
        columns = torch.tensor(plan.migration.columns, dtype=torch.long)
        gx_m, gw_m = _recv(scheduler, group, plan.migration.taker, x.new_empty((*x.shape[:-1], len(columns))), weight.new_empty((out, len(columns))))
        grad_x[..., columns] = gx_m
        grad_w[:, columns] = gw_m
    elif plan.taken():
        x_m, w_m = plan.stash.pop()
        _send(scheduler, group, plan.migration.giver, grad.matmul(w_m), g2.t().matmul(x_m.reshape(-1, x_m.shape[-1])))
    return grad_x, grad_w, bias_grad


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
    """|X_D W_D^T| / |X W^T| on the first few rows: what resizing left out of this output."""
    dropped = sorted(set(range(plan.width)) - set(plan.kept))
    if not dropped:
        return 0.0
    with torch.no_grad():
        rows = x.reshape(-1, plan.width)[: plan.sample_rows]
        index = torch.tensor(dropped, dtype=torch.long)
        missing = rows.index_select(1, index) @ weight.index_select(1, index).t()
        full = y.reshape(-1, weight.shape[0])[: plan.sample_rows] - (bias if bias is not None else 0) + missing
        return float(missing.norm() / full.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- the plans


def priority_columns(weight: torch.Tensor, snapshot: torch.Tensor | None, keep: int) -> list[int]:
    """The `keep` contraction columns whose weights changed most since `snapshot` (the
    largest columns when there is none); ties go to the lower index."""
    change = weight if snapshot is None else weight - snapshot
    score = change.detach().double().norm(dim=0)
    order = sorted(range(score.numel()), key=lambda j: (-float(score[j]), j))
    return sorted(order[:keep])


class Resizer:
    """The resizable linears of one module on this rank and their current plans.

    `linears`: key -> (weight parameter, "column" | "row"); the contraction dim is dim 1.
    """

    def __init__(self, linears: dict[str, tuple[torch.Tensor, str]], op_state: dict, tp_rank: int, tp_size: int):
        self.linears = linears
        self.op_state = op_state
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.fraction = 1.0  # kept fraction on this rank (1: full width)
        self.migration: dict | None = None  # {"giver", "taker", "fraction"} in tp indices
        self.snapshots: dict[str, torch.Tensor] = {}  # weights at the last selection
        for key, (weight, kind) in linears.items():
            op_state[state_key(key)] = LinearPlan(key, kind, weight.shape[1], tp_rank)

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
        """Full width and no migration: plain tensor parallelism."""
        self.resize(1.0)
        self.migrate(0, 0, 0.0)

    def error(self) -> float:
        """Largest relative error a resized linear made in the last forward (0 when none is)."""
        return max((self.plan(key).error for key in self.linears if self.plan(key).kept is not None), default=0.0)

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
        }

    def load_state_dict(self, state: dict) -> None:
        self.fraction = state["fraction"]
        for key, kept in state["kept"].items():
            self.plan(key).kept = kept
            self.plan(key).changed()
        self.snapshots = {key: t.clone() for key, t in state.get("snapshots", {}).items()}
        migration = state.get("migration")
        self.migrate(migration["giver"], migration["taker"], migration["fraction"]) if migration else self.migrate(0, 0, 0.0)


__all__ = ["LinearPlan", "Migration", "Resizer", "linear_backward", "linear_forward", "priority_columns", "state_key"]
