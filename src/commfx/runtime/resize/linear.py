"""The `commfx.tp_linear` op's two halves: a plain linear unless this rank's `LinearPlan`
says otherwise, then computed on views of the kept units (`unit_views.py`) or on an index
of the columns and rows this rank computes (`columns.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import CommScheduler, current_scheduler
from .columns import indexed_backward, indexed_forward
from .linear_plan import LinearPlan, state_key
from .unit_views import cut_backward, cut_forward


def _plan(key: str) -> tuple[LinearPlan | None, CommScheduler]:
    scheduler = current_scheduler()
    return scheduler.op_state.get(state_key(key)), scheduler


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str, group: str) -> torch.Tensor:
    plan, scheduler = _plan(key)
    if plan is None or plan.is_plain():
        return F.linear(x, weight, bias)
    if plan.on_views():
        return cut_forward(plan, x, weight, bias)
    return indexed_forward(plan, scheduler, group, x, weight, bias)


def linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, key: str, group: str):
    plan, scheduler = _plan(key)
    if plan is None or plan.is_plain():
        out, width = weight.shape
        g2 = grad.reshape(-1, out)
        bias_grad = g2.sum(0) if has_bias else weight.new_empty((0,))
        return grad.matmul(weight), g2.t().matmul(x.reshape(-1, width)), bias_grad
    if plan.on_views():
        return cut_backward(plan, grad, x, weight, has_bias)
    return indexed_backward(plan, scheduler, group, grad, x, weight, has_bias)
