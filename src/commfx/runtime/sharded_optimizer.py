"""The sharded optimizer of the shard_states pass (ZeRO stages 1 to 3).

`shard_optimizer(dm, torch.optim.AdamW, lr=...)` is to a commfx module what torch's
`ZeroRedundancyOptimizer(params, optimizer_class=..., **defaults)` is to DDP: any torch
optimizer that updates each parameter from its own gradient and state (SGD, Adam, AdamW)
runs on this rank's shard only, so its state (Adam's two moments) is 1/P of the
replicated one. Its `param_groups` hold the module's own parameters (LR schedulers and
hooks see a normal optimizer); before each step their hyperparameters are copied to the
inner optimizer, whose parameters are 1-D views of the part of each parameter this rank
owns (no copy: stepping a view updates the parameter in place). After the step the
owned parts are all-gathered, bucket by bucket, so every rank holds every parameter again;
at stage 3 the inner parameters are views of the parameter shards (`param_gather.py`) and
nothing is gathered after the step: the next forward gathers each bucket before its use.

Gradients: stage 1 reads this rank's part of each full `.grad`; stage 2 the shard of the
reduced gradient the reduce-scatter left (`state_shards.py`). Parameters outside the
buckets (gradients reduced in the graph) are stepped whole on every rank, as replicated.
`state_dict()` holds this rank's shard of the state and the layout it was cut by; it loads
on the same layout (world, plan and bucket size) only.
"""

from __future__ import annotations

from typing import Any

import torch

from .state_shards import BucketShard, ShardedGradSync


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, module: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer], params=None, **defaults: Any):
        sync = getattr(module, "grad_sync", None)
        if not isinstance(sync, ShardedGradSync):
            raise TypeError("ShardedOptimizer needs a module distributed with shard_states in its plan; use commfx.shard_optimizer")
        super().__init__(module.parameters() if params is None else params, defaults)
        self.sync = sync
        self.module = module
        where: dict[int, tuple[BucketShard, int]] = {}
        for shard in sync.shards:
            for slot in shard.bucket.slots:
                where.setdefault(id(sync.slots[slot].param), (shard, slot))
        self._parts: list[tuple[torch.nn.Parameter, BucketShard | None, int, int, int, torch.Tensor]] = []
        inner_groups = []
        for group in self.param_groups:
            views = []
            for param in group["params"]:
                shard, slot = where.get(id(param), (None, -1))
                lo, hi = shard.owned(slot, param.numel()) if shard is not None else (0, param.numel())
                if shard is not None and shard.params is not None:  # stage 3: the shard is all this rank holds
                    begin = shard.starts[slot] + lo - shard.range[0]
                    view = shard.params[begin : begin + hi - lo]
                else:
                    view = param.detach().view(-1)[lo:hi]
                self._parts.append((param, shard, slot, lo, hi, view))
                if hi > lo:
                    views.append(view)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": views})
        self.optimizer = optimizer_class(inner_groups, **defaults)
        sync.optimizer_attached = True

    @property
    def layout(self) -> list[tuple[str, int, int, int]]:
        """(group, ranks, this rank's index, elements) per bucket: what the shards were cut by."""
        return [(s.bucket.group, s.parts, s.index, s.numel) for s in self.sync.shards]

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "optimizer"):
            raise NotImplementedError("a sharded optimizer's parameter groups are fixed when it is made; pass them all to shard_optimizer")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._hyperparameters_inward()
        for param, shard, slot, lo, hi, view in self._parts:
            stage3 = shard is not None and shard.params is not None
            if not stage3 and view.data_ptr() != param.data_ptr() + lo * param.element_size():  # the parameter's storage was replaced
                view.set_(param.detach().untyped_storage(), param.storage_offset() + lo, (hi - lo,))
            view.grad = self._grad(param, shard, slot, lo, hi)
        try:
            self.optimizer.step()
        finally:
            for *_, view in self._parts:
                view.grad = None
        self._gather()
        return loss

    def _grad(self, param, shard: BucketShard | None, slot: int, lo: int, hi: int) -> torch.Tensor | None:
        if shard is None or self.sync.stage < 2:
            return None if param.grad is None else param.grad.detach().reshape(-1)[lo:hi]
        if shard.grad is None or slot not in shard.had_grad:
            return None
        begin = shard.starts[slot] + lo - shard.range[0]
        return shard.grad[begin : begin + hi - lo]

    def _gather(self) -> None:
        """All-gather every bucket's owned parts into every rank's parameters (stage 3: free
        the stale whole buckets; the next forward gathers the stepped shards)."""
        if self.sync.params is not None:
            return self.sync.params.release()
        scheduler, params = self.sync.scheduler, self.sync.slots
        started = []
        for shard in self.sync.shards:
            if shard.parts == 1:
                continue
            pieces = []
            for slot in shard.bucket.slots:
                param = params[slot].param
                lo, hi = shard.owned(slot, param.numel())
                pieces.append(param.detach().reshape(-1)[lo:hi])
            mine = torch.cat(pieces)
            if mine.numel() < shard.size:
                mine = torch.cat([mine, mine.new_zeros(shard.size - mine.numel())])
            full = mine.new_empty(shard.size * shard.parts)
            tag = f"bucket {shard.bucket.index}"
            started.append((shard, full, scheduler.start_sharded("all_gather", full, mine, shard.bucket.group, "param_all_gather", tag=tag)))
        for shard, full, pending in started:
            scheduler.wait(pending)
            for slot in shard.bucket.slots:
                param = params[slot].param
                start = shard.starts[slot]
                param.detach().view(-1).copy_(full[start : start + param.numel()])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.sync.clear_grads()

    def _hyperparameters_inward(self) -> None:
        """The outer groups' hyperparameters (an LR scheduler sets those) into the inner optimizer."""
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    def state_dict(self) -> dict:
        self._hyperparameters_inward()
        return {"sharded": self.optimizer.state_dict(), "layout": self.layout}

    def load_state_dict(self, state_dict: dict) -> None:
        if [tuple(b) for b in state_dict.get("layout", [])] != self.layout:
            raise ValueError(
                "this optimizer state was sharded by another layout (world size, plan or bucket size differ); "
                "load it where it was saved"
            )
        self.optimizer.load_state_dict(state_dict["sharded"])
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update({k: v for k, v in inner.items() if k in outer and k != "params"})

    @property
    def held(self) -> list[torch.Tensor]:
        """The tensors of this rank's optimizer state (for memory reports)."""
        return [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def shard_optimizer(module: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer], params=None, **defaults: Any) -> torch.optim.Optimizer:
    """The optimizer for `module`'s plan: sharded over its data-parallel ranks under
    shard_states, else `optimizer_class` over `params` (default: all of the module's)."""
    if isinstance(getattr(module, "grad_sync", None), ShardedGradSync):
        return ShardedOptimizer(module, optimizer_class, params, **defaults)
    return optimizer_class(module.parameters() if params is None else params, **defaults)
