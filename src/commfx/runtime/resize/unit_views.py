"""A rank that computes only the first units of its shard, on views of them (no gathers).

Used by unit resizing (the last units dropped: nobody computes them, their gradients are
imputed zero) and by a unit migration giver (the last units given away: the taker computes
them). `LinearPlan.units.cut` = (outer, heads/columns, inner, kept) says how a weight's dim
is laid out and how many of each outer part's heads/columns are kept; the kept ones are
one range where there is one outer part (MLP columns, a row-parallel linear's columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear_plan import LinearPlan


def _cut(t: torch.Tensor, dim: int, plan: LinearPlan) -> torch.Tensor:
    """The kept heads/columns of `t` along `dim` (a view: outer x kept x inner of outer x per x inner)."""
    outer, per, inner, kept = plan.units.cut
    dim = dim % t.dim()
    return t.unflatten(dim, (outer, per, inner)).narrow(dim + 1, 0, kept)


def _kept(t: torch.Tensor, dim: int, plan: LinearPlan) -> torch.Tensor:
    """The kept heads/columns of a 2-d `t` along `dim`: a view where they are one range (one
    outer part: MLP columns, a row-parallel linear's), else a copy."""
    outer, per, inner, kept = plan.units.cut
    if outer == 1:
        return t.narrow(dim, 0, kept * inner)
    return _cut(t, dim, plan).flatten(dim, dim + 2)


def _put(t: torch.Tensor, dim: int, plan: LinearPlan, value: torch.Tensor) -> torch.Tensor:
    """Write `value` (the kept heads/columns) into a 2-d `t` along `dim`; returns `t`."""
    outer, per, inner, kept = plan.units.cut
    if outer == 1:
        t.narrow(dim, 0, kept * inner).copy_(value)
    else:
        _cut(t, dim, plan).copy_(value.unflatten(dim, (outer, kept, inner)))
    return t


def cut_forward(plan: LinearPlan, x, weight, bias):
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
        if plan.units.dropped:
            plan.error = _dropped_units_error(plan, x2, weight)
    return y2.view(*x.shape[:-1], out)


def _dropped_units_error(plan: LinearPlan, x2, weight) -> float:
    """Unit resizing: |X W_D^T| / |X W_C^T| on the first few rows, D the dropped units' rows
    and C those this rank is responsible for (kept and dropped, not given away): the share of
    the block's activations that resizing left out."""
    outer, per, inner, kept = plan.units.cut
    with torch.no_grad():
        full = (x2[: plan.sample_rows] @ weight.t()).unflatten(1, (outer, per, inner))
        dropped = full.narrow(2, kept, plan.units.dropped).norm()
        return float(dropped / full.narrow(2, 0, kept + plan.units.dropped).norm().clamp_min(1e-30))


def cut_backward(plan: LinearPlan, grad, x, weight, has_bias):
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
