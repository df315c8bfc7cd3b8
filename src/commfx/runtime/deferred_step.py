"""The optimizer step a deferred gradient missed (the defer_grad_sync pass).

With the gradient all-reduce running on into the next forward, `optimizer.step()` comes
before some gradients are in. This keeps the step's meaning: a pre-step hook takes those
parameters out of that step (their `.grad` set aside, the step's hyperparameters noted:
an LR scheduler may change them right after), and when a parameter's reduced gradient is
settled (the next forward's first use of it, the next backward, `synchronize`) the same
optimizer steps just those parameters with the noted hyperparameters. Every parameter
gets exactly the update it would have had: torch's optimizers update each parameter from
its own gradient and state (SGD, momentum, Adam, AdamW: float64-tested). An optimizer that
couples parameters (LBFGS, a global-norm clip inside step) is not for this mode.

If no step came before the gradient arrives (gradient accumulation over micro-batches),
the reduced gradient is added into `.grad` like any other, for the next step to use.
"""

from __future__ import annotations

import torch

from .grad_sync import GradientSync

_CATCHING_UP: set[int] = set()  # id() of optimizers inside a catch-up step (step_only)


def catching_up(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is inside a catch-up `step_only` (step hooks of training steps
    should ignore it: it is not a new step)."""
    return id(optimizer) in _CATCHING_UP


def step_only(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], hyperparameters: list[dict]) -> None:
    """optimizer.step() over `params` alone, with the hyperparameters (per param group) of
    the step they missed; the other parameters' gradients are set aside meanwhile."""
    chosen = {id(p) for p in params}
    current, others = [], {}
    for group, then in zip(optimizer.param_groups, hyperparameters):
        current.append({k: group[k] for k in then})
        group.update(then)
        for other in group["params"]:
            if id(other) not in chosen and other.grad is not None:
                others[other] = other.grad
                other.grad = None
    _CATCHING_UP.add(id(optimizer))
    try:
        optimizer.step()
    finally:
        _CATCHING_UP.discard(id(optimizer))
        for group, now in zip(optimizer.param_groups, current):
            group.update(now)
        for other, grad in others.items():
            other.grad = grad


def hyperparameters_of(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters now (an LR scheduler may change them after the step)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class DeferredStep:
    def __init__(self, grad_sync: GradientSync):
        self.sync = grad_sync
        self.optimizer: torch.optim.Optimizer | None = None
        self.caught_up = 0  # parameters stepped after their optimizer step, so far (for tests and reports)
        self.ordered = False  # the urgent buckets are chosen (at the first forward)
        self._missed: dict[int, tuple[list[dict], torch.Tensor | None]] = {}  # slot -> (hyperparameters, grad set aside)

    def order(self, position: dict[int, float]) -> None:
        """Where the forward first uses each parameter (0..1): the urgent buckets go first."""
        self.sync.order_for_forward(position)
        self.ordered = True

    @property
    def pending(self) -> bool:
        return self.sync.pending

    @property
    def stepping(self) -> bool:
        """Inside a catch-up step (other step hooks should ignore it)."""
        return self.optimizer is not None and catching_up(self.optimizer)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Defer from now on: `optimizer`'s steps skip, then catch up, deferred parameters."""
        self.optimizer = optimizer
        self.sync.defer = True
        self.sync.scheduler.dispatcher.enforce_priority = True  # gradient lanes yield to critical traffic, urgent ones first
        optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if catching_up(optimizer) or not self.sync.pending:
            return
        hyperparameters = hyperparameters_of(optimizer)
        for slot in self.sync.in_flight:
            if slot in self._missed:
                raise RuntimeError("optimizer.step() twice while a gradient was still on the wire; call synchronize() between")
            param = self.sync.slots[slot].param
            self._missed[slot] = (hyperparameters, param.grad)
            param.grad = None  # not in this step; settle() steps it

    def settle(self, slots=None) -> None:
        """Wait for the deferred gradients of `slots` (all by default) and apply them."""
        if not self.sync.pending:
            return
        catch_up: dict[int, tuple[list[dict], list[torch.nn.Parameter]]] = {}
        for slot, reduced in self.sync.settle(slots).items():
            param = self.sync.slots[slot].param
            if slot in self._missed:
                hyperparameters, earlier = self._missed.pop(slot)
                param.grad = reduced if earlier is None else earlier + reduced
                catch_up.setdefault(id(hyperparameters), (hyperparameters, []))[1].append(param)
            else:
                param.grad = reduced if param.grad is None else param.grad.add_(reduced)
        for hyperparameters, params in catch_up.values():
            self._step_only(params, hyperparameters)
            self.caught_up += len(params)
            for param in params:
                param.grad = None  # stepped: the next backward starts it afresh

    def _step_only(self, params: list[torch.nn.Parameter], hyperparameters: list[dict]) -> None:
        step_only(self.optimizer, params, hyperparameters)
