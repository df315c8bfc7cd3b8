"""Gradients of weights that no compiled graph holds, synchronised like the graphs' own.

Under torch.compile a graph break inside a Python loop makes dynamo run that whole frame
eagerly (a model's embeddings and head, when its layer loop breaks). No graph, so no
backend, ever sees those weights, and each rank would keep its own gradient. Given the
model, the backend watches every parameter: one whose gradient is accumulated while no
graph holds it is all-reduced over the world right then (autograd runs the hooks in the
same order on every rank, so the collectives match).
"""

from __future__ import annotations

import torch

from .comm import CommScheduler


class EagerGradientSync:
    def __init__(self, scheduler: CommScheduler, scale: float):
        self.scheduler = scheduler
        self.scale = scale
        self.in_graphs: set[int] = set()  # ids of parameters some compiled graph takes (its own sync reduces them)
        self.reduced: list[str] = []  # names reduced here, in order, for tests and reports

    def watch(self, model: torch.nn.Module) -> None:
        seen: set[int] = set()
        for name, param in model.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                param.register_post_accumulate_grad_hook(lambda p, name=name: self._accumulated(name, p))

    def _accumulated(self, name: str, param: torch.Tensor) -> None:
        if id(param) in self.in_graphs or self.scheduler.group("world").size == 1:
            return
        self.scheduler.all_reduce(param.grad, "world", kind="eager_grad")
        param.grad.mul_(self.scale)
        self.reduced.append(name)
