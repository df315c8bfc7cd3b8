"""runtime/row_step.py: an optimizer step applied to a table's rows in two parts (schedule=2d's
next-batch rows, then the rest) gives every row what the whole-table step gives, its state
too, the step count advancing once per step, with an LR scheduler between steps; rows
whose gradient is zero still decay (Adam's moments, weight decay). Optimizers whose update
is not elementwise are not split."""

import pytest
import torch

from commfx.runtime.deferred_step import hyperparameters_of
from commfx.runtime.row_step import splits_by_rows, state_before, step_rows

ROWS, WIDTH, STEPS = 10, 3, 4
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd dampened nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05),
    "adam amsgrad weight decay": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
}


def _gradients():
    """Per step a table gradient whose rows 6.. are zero in some steps (rows the batch did not touch)."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64) for _ in range(STEPS)]
    grads[0][6:] = 0
    grads[2][3:] = 0
    return grads


def _train(make, split: bool):
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(ROWS, WIDTH, dtype=torch.float64))
    other = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    optimizer = make([table, other])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for step, grad in enumerate(_gradients()):
        other.grad = torch.full((4,), float(step + 1), dtype=torch.float64)
        if not split:
            table.grad = grad.clone()
            optimizer.step()
        else:  # the table misses the step; its rows are stepped afterwards, in two parts
            hyperparameters = hyperparameters_of(optimizer)
            optimizer.step()
            before = state_before(optimizer, table)
            first = torch.tensor([step % ROWS, 4, 7]).unique()
            rest = torch.tensor([r for r in range(ROWS) if r not in first.tolist()])
            for rows in (first, rest):
                step_rows(optimizer, table, rows, grad[rows].clone(), hyperparameters, before)
        scheduler.step()
        other.grad = None
    return table.detach(), other.detach(), optimizer


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_row_parts_give_the_whole_table_step(name):
    whole, other, optimizer = _train(OPTIMIZERS[name], split=False)
    parts, other_parts, split_optimizer = _train(OPTIMIZERS[name], split=True)
    assert splits_by_rows(optimizer)
    assert (parts - whole).abs().max().item() <= 1e-12
    assert torch.equal(other, other_parts)  # the other parameter stepped once per step, by its own gradient
    initial = _train(lambda p: torch.optim.SGD(p, lr=0.0), split=False)[0]
    assert (whole - initial).abs()[6:].min() > 0  # rows without gradient in some steps moved too
    for param, split_param in zip(optimizer.param_groups[0]["params"], split_optimizer.param_groups[0]["params"]):
        state, split_state = optimizer.state[param], split_optimizer.state[split_param]
        assert state.keys() == split_state.keys()
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert (value.double() - split_state[key].double()).abs().max().item() <= 1e-12, (name, key)
    if "adam" in name:
        assert float(split_optimizer.state[split_optimizer.param_groups[0]["params"][0]]["step"]) == STEPS


def test_optimizers_whose_update_is_not_elementwise_are_not_split():
    table = torch.nn.Parameter(torch.zeros(3, 2))
    assert not splits_by_rows(torch.optim.LBFGS([table]))
    assert not splits_by_rows(torch.optim.Adagrad([table]))
    assert not splits_by_rows(torch.optim.Adam([table], differentiable=True))

    class Custom(torch.optim.AdamW):  # a subclass may change the update
        pass

    assert not splits_by_rows(Custom([table]))
