"""One optimizer step of a parameter, applied to some of its rows at a time.

split_embedding_comm:schedule=2d steps a table's rows the next batch reads as soon as
their gradients are in and the other rows when theirs arrive. Each part is stepped by the
same optimizer on a stand-in parameter holding just those rows, with those rows of its
row-wise state (momentum buffer, Adam's moments) and the scalar state (Adam's `step`) it
had before the step: every part starts from the same count, so the count advances once
per step, and each row gets exactly the update of the whole-table step. Exact for
optimizers whose update is elementwise in the parameter and its state: torch's SGD, Adam
and AdamW (`splits_by_rows`).
"""

from __future__ import annotations

import torch

from .deferred_step import step_only

SPLITTABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def splits_by_rows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_rows` gives `optimizer`'s own update (its class's update is elementwise)."""
    return type(optimizer) in SPLITTABLE and not any(g.get("differentiable") for g in optimizer.param_groups)


def _row_wise(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def state_before(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict | None:
    """`param`'s scalar optimizer state before a step, which each part of that step starts
    from (None: no state yet, so each part starts afresh as the first step would)."""
    state = optimizer.state.get(param)
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items() if not _row_wise(v, param)}


def step_rows(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, rows: torch.Tensor, grad: torch.Tensor,
              hyperparameters: list[dict], before: dict | None) -> None:
    """Apply to `param`'s `rows` (distinct row indices) what `optimizer`'s step with
    `hyperparameters` (per param group) does to them, given their gradient `grad`
    ([len(rows), ...]) and the scalar state `before` that step (`state_before`)."""
    if rows.numel() == 0:
        return
    state = optimizer.state[param]
    stand_in = torch.nn.Parameter(param.detach().index_select(0, rows))
    stand_in.grad = grad
    part = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in (before or {}).items()}
    if before is not None:
        part.update({k: v.index_select(0, rows) for k, v in state.items() if _row_wise(v, param)})
    group, index = _place_of(optimizer, param)
    group["params"][index] = stand_in
    optimizer.state[stand_in] = part
    try:
        step_only(optimizer, [stand_in], hyperparameters)
    finally:
        group["params"][index] = param
        stepped = optimizer.state.pop(stand_in, {})
    with torch.no_grad():
        param.index_copy_(0, rows, stand_in.detach())
    for key, value in stepped.items():
        if _row_wise(value, stand_in):
            whole = state.get(key)
            if not _row_wise(whole, param):
                whole = state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
            whole.index_copy_(0, rows, value)
        else:
            state[key] = value


def _place_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[dict, int]:
    for group in optimizer.param_groups:
        for index, p in enumerate(group["params"]):
            if p is param:
                return group, index
    raise ValueError("the parameter is not one of the optimizer's")
