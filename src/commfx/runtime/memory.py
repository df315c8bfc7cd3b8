"""Bytes of training state one rank holds: parameters, gradients and optimizer state.

Counted from the tensors the module and the optimizer hold (each storage once, whichever
tensors view it: gradients that are views of one flat bucket count as that bucket), not
from an allocator, so the figure is the same on any device and says what sharding saves.
Taken after a step, before gradients are zeroed, it is the step's peak of held state
(communication buffers in flight are not held state and are not counted).
"""

from __future__ import annotations

import torch

from .state_shards import ShardedGradSync


def held_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state", "total"}: bytes this rank holds."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    params = list(module.parameters())
    sync = getattr(module, "grad_sync", None)
    shards = sync.shards if isinstance(sync, ShardedGradSync) else []
    shard_grads = [s.grad for s in shards]
    report = {
        "parameters": count(params + [s.params for s in shards]),  # stage 3: whole buckets are freed between uses
        "gradients": count([p.grad for p in params] + shard_grads),
        "optimizer_state": count(_state_tensors(optimizer)) if optimizer is not None else 0,
    }
    report["total"] = sum(report.values())
    return report


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    held = getattr(optimizer, "held", None)
    if held is not None:
        return held
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
