"""Column resizing and column migration, computed on an index of this rank's columns.

Resizing: a slow rank contracts over the kept columns S only (`priority_columns`: those
whose weights changed most since the last selection) and imputes zeros at the dropped
positions of both gradients. Migration: the giver sends X[..., M] and W[:, M] of its
row-parallel linears to the taker, which adds X_M W_M^T to its own partial product and
returns dX_M and dW_M in backward. The same index path also serves a unit migration giver
whose plan mixes in column resizing or migration (its skipped rows and columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...plan import DEFAULT_CLASS
from ..comm import CommScheduler
from .linear_plan import LinearPlan

KIND = "tp_migrate"  # what the comm stats call migration traffic


def indexed_forward(plan: LinearPlan, scheduler: CommScheduler, group: str, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """The columns this rank multiplies (kept, less those given away) and the rows it
    computes; a taker adds the migrated columns' product, a giver sends them."""
    index, rows = plan.compute_index(), plan.row_index()
    xs = x if index is None else x.index_select(-1, index)
    w = weight if index is None else weight.index_select(1, index)
    if rows is None:
        y = F.linear(xs, w, bias)
    else:  # unit migration: the rows of the given units are another rank's (zeros here)
        part = F.linear(xs, w.index_select(0, rows), None if bias is None else bias.index_select(0, rows))
        y = x.new_zeros((*x.shape[:-1], weight.shape[0])).index_copy_(-1, rows, part)
    plan.rows = x.numel() // max(x.shape[-1], 1)
    if plan.columns.migration is not None:
        columns = torch.tensor(plan.columns.migration.columns, dtype=torch.long)
        if plan.given():
            _send(scheduler, group, plan.columns.migration.taker, x.index_select(-1, columns), weight.index_select(1, columns))
        elif plan.taken():
            count = len(plan.columns.migration.columns)
            x_m, w_m = _recv(scheduler, group, plan.columns.migration.giver, x.new_empty((*x.shape[:-1], count)), weight.new_empty((weight.shape[0], count)))
            plan.columns.stash.append((x_m, w_m))
            y = y + F.linear(x_m, w_m)
    if plan.columns.kept is not None:
        plan.error = _dropped_error(plan, x, weight, bias, y)
    return y


def indexed_backward(plan: LinearPlan, scheduler: CommScheduler, group: str, grad: torch.Tensor, x: torch.Tensor,
                     weight: torch.Tensor, has_bias: bool):
    """Gradients with zeros imputed at the columns (and rows) this rank did not compute;
    a giver receives the migrated columns' gradients, a taker sends them."""
    out, width = weight.shape
    g2 = grad.reshape(-1, out)
    x2 = x.reshape(-1, width)
    bias_grad = g2.sum(0) if has_bias else weight.new_empty((0,))
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
        columns = torch.tensor(plan.columns.migration.columns, dtype=torch.long)
        gx_m, gw_m = _recv(scheduler, group, plan.columns.migration.taker, x.new_empty((*x.shape[:-1], len(columns))), weight.new_empty((out, len(columns))))
        grad_x[..., columns] = gx_m
        grad_w[:, columns] = gw_m
    elif plan.taken():
        x_m, w_m = plan.columns.stash.pop()
        _send(scheduler, group, plan.columns.migration.giver, grad.matmul(w_m), g2.t().matmul(x_m.reshape(-1, x_m.shape[-1])))
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
    """|X_D W_D^T| / |X W^T| on the first few rows: what resizing left out of this output
    (the full product of those rows less the kept one: no gather of the dropped columns)."""
    with torch.no_grad():
        rows = x.reshape(-1, plan.width)[: plan.sample_rows]
        full = rows @ weight.t()
        kept = y.reshape(-1, weight.shape[0])[: rows.shape[0]] - (bias if bias is not None else 0)
        if plan.given():  # columns another rank computes are not dropped
            columns = torch.tensor(plan.columns.migration.columns, dtype=torch.long)
            kept = kept + rows.index_select(1, columns) @ weight.index_select(1, columns).t()
        if plan.row_index() is not None:  # ... nor the rows of units it computes
            full, kept = full.index_select(1, plan.row_index()), kept.index_select(1, plan.row_index())
        return float((full - kept).norm() / full.norm().clamp_min(1e-30))


def priority_columns(weight: torch.Tensor, snapshot: torch.Tensor | None, keep: int) -> list[int]:
    """The `keep` contraction columns whose weights changed most since `snapshot` (the
    largest columns when there is none); ties go to the lower index."""
    change = weight if snapshot is None else weight - snapshot
    score = change.detach().double().norm(dim=0)
    order = sorted(range(score.numel()), key=lambda j: (-float(score[j]), j))
    return sorted(order[:keep])
