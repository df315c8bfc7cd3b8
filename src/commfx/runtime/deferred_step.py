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

`step=forward` (`step_in_forward`) takes every parameter out of the step, not only those
still on the wire: the optimizer's work moves into the next forward, where each parameter
is stepped while the forward waits on an all-to-all (`while_waiting`, the parameters
needed soonest first) or, at the latest, just before its first use. On a link-bound
step the optimizer's compute then hides behind transfers instead of running while the
link idles between backward and forward.

If no step came before the gradient arrives (gradient accumulation over micro-batches),
the reduced gradient is added into `.grad` like any other, for the next step to use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .grad_sync import GradientSync

# while_waiting steps about this many parameter elements at a time, then looks at the wire
# again (~1 ms of AdamW on one CPU core).
WAITING_BATCH_ELEMENTS = 1 << 20


@dataclass
class Missed:
    """A parameter an optimizer step left out: that step's hyperparameters, the gradient it
    had then, and whether its reduced gradient is still on the wire."""

    param: torch.Tensor
    hyperparameters: list[dict]
    grad: torch.Tensor | None
    on_wire: bool


class DeferredStep:
    def __init__(self, grad_sync: GradientSync, *, step_in_forward: bool = False):
        self.sync = grad_sync
        self.step_in_forward = step_in_forward
        self.optimizer: torch.optim.Optimizer | None = None
        self.stepping = False  # inside our own optimizer.step() (other step hooks should ignore it)
        self.caught_up = 0  # parameters stepped after their optimizer step, so far (for tests and reports)
        self.ordered = False  # the urgent buckets are chosen (at the first forward)
        self.timeline: Callable[[], object | None] = lambda: None  # where catch-up steps are traced
        self._settling = False
        self._missed: dict[int, Missed] = {}  # slot -> what its optimizer step left out
        self._first_use: dict[int, float] = {}  # slot -> where the forward first uses it (0..1)

    def order(self, position: dict[int, float]) -> None:
        """Where the forward first uses each slot's parameter (0..1): the urgent buckets go
        first, and `while_waiting` steps parameters in this order."""
        self.sync.order_for_forward(position)
        self._first_use = dict(position)
        self.ordered = True

    @property
    def pending(self) -> bool:
        return self.sync.pending or bool(self._missed)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Defer from now on: `optimizer`'s steps skip, then catch up, deferred parameters."""
        self.optimizer = optimizer
        self.sync.defer = True
        self.sync.scheduler.dispatcher.enforce_priority = True  # gradient lanes yield to critical traffic, urgent ones first
        if self.step_in_forward:
            self.sync.scheduler.while_waiting = self.while_waiting
        optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self.stepping or not (self.sync.pending or self.step_in_forward):
            return
        hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        for slot, entry in enumerate(self.sync.slots):
            on_wire = slot in self.sync.in_flight
            if not on_wire and (not self.step_in_forward or entry.param.grad is None):
                continue
            if slot in self._missed:
                raise RuntimeError("optimizer.step() twice while a gradient was still on the wire; call synchronize() between")
            self._missed[slot] = Missed(entry.param, hyperparameters, entry.param.grad, on_wire)
            entry.param.grad = None  # not in this step; settle() steps it

    def settle(self, slots=None) -> None:
        """Make the parameters of `slots` (all by default) current: wait for their deferred
        gradients and apply the optimizer steps they missed."""
        if not self.pending:
            return
        wanted = None if slots is None else set(slots)
        self._settling = True
        try:
            for slot, reduced in self.sync.settle(slots).items():
                missed = self._missed.get(slot)
                if missed is not None and missed.on_wire:
                    missed.grad = reduced if missed.grad is None else missed.grad + reduced
                    missed.on_wire = False
                else:  # no step came since this backward (accumulation): the next one uses it
                    param = self.sync.slots[slot].param
                    param.grad = reduced if param.grad is None else param.grad.add_(reduced)
            self._catch_up([
                slot for slot, missed in self._missed.items()
                if not missed.on_wire and (wanted is None or slot in wanted or not self.step_in_forward)
            ])
        finally:
            self._settling = False

    def while_waiting(self) -> bool:
        """Called by the comm scheduler while the forward waits on the wire: step the next
        few parameters whose gradients are in, those the forward needs soonest first.
        False when there is nothing to step."""
        if self.stepping or self._settling:
            return False
        ready = sorted((slot for slot, m in self._missed.items() if not m.on_wire), key=lambda slot: self._first_use.get(slot, 1.0))
        batch, elements = [], 0
        for slot in ready:
            if elements >= WAITING_BATCH_ELEMENTS:
                break
            batch.append(slot)
            elements += self._missed[slot].param.numel()
        self._catch_up(batch)
        return bool(batch)

    def _catch_up(self, slots: list[int]) -> None:
        """Step the parameters of `slots` with the hyperparameters of the step they missed."""
        if not slots:
            return
        start = time.perf_counter()
        by_step: dict[int, tuple[list[dict], list[torch.Tensor]]] = {}
        for slot in slots:
            missed = self._missed.pop(slot)
            missed.param.grad = missed.grad
            by_step.setdefault(id(missed.hyperparameters), (missed.hyperparameters, []))[1].append(missed.param)
        for hyperparameters, params in by_step.values():
            self._step_only(params, hyperparameters)
            self.caught_up += len(params)
            for param in params:
                param.grad = None  # stepped: the next backward starts it afresh
        timeline = self.timeline()
        if timeline is not None:
            timeline.work("optimizer step", f"{len(slots)} parameters", "optimizer", start, time.perf_counter())

    def _step_only(self, params: list[torch.Tensor], hyperparameters: list[dict]) -> None:
        """optimizer.step() over `params` alone, with the hyperparameters of the step they missed."""
        optimizer, chosen = self.optimizer, {id(p) for p in params}
        current, others = [], {}
        for group, then in zip(optimizer.param_groups, hyperparameters):
            current.append({k: group[k] for k in then})
            group.update(then)
            for other in group["params"]:
                if id(other) not in chosen and other.grad is not None:
                    others[other] = other.grad
                    other.grad = None
        self.stepping = True
        try:
            optimizer.step()
        finally:
            self.stepping = False
            for group, now in zip(optimizer.param_groups, current):
                group.update(now)
            for other, grad in others.items():
                other.grad = grad
