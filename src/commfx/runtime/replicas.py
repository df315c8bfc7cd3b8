"""Replicated state must start equal on every rank.

Data parallelism averages gradients, so replicas that start apart stay apart: a model
built on each rank from a different seed trains diverging copies with no error. These
check that every rank holds the same parameters and buffers (a digest of each tensor's
bytes, gathered once) or make them equal (a broadcast from rank 0), before capture.
"""

from __future__ import annotations

import hashlib

import torch

from ..plan import PlanError
from .comm import CommScheduler

REPLICA_MODES = ("check", "broadcast", "off")


class ReplicaMismatch(PlanError):
    """Ranks hold different values for tensors that must be replicated."""


def named_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, by name, each once (tied tensors under their first name)."""
    seen: set[int] = set()
    state = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            state.append((name, tensor))
    return state


def digest(tensor: torch.Tensor) -> str:
    """A digest of the tensor's bytes (any dtype, any device)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


def check_replicas(scheduler: CommScheduler, state: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ReplicaMismatch naming the tensors that differ from rank 0's (same on every rank)."""
    mine = [(name, tuple(t.shape), digest(t)) for name, t in state]
    everyone = scheduler.all_gather_object(mine)
    differing: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone[1:], start=1):
        if [entry[:2] for entry in theirs] != [entry[:2] for entry in everyone[0]]:
            raise ReplicaMismatch(
                f"rank {rank} built a model with other parameter names or shapes than rank 0's; build the same model "
                "on every rank"
            )
        for (name, _, ours), (_, _, other) in zip(everyone[0], theirs):
            if ours != other:
                differing.setdefault(name, []).append(rank)
    if differing:
        names = list(differing)
        listed = ", ".join(f"{n} (rank {', '.join(map(str, differing[n]))})" for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise ReplicaMismatch(
            f"{len(names)} parameter(s) or buffer(s) differ from rank 0's: {listed}{more}. Replicas that start apart "
            "train apart: build the model from the same seed on every rank or load the same checkpoint, or pass "
            "replicas='broadcast' to commfx.distribute to take rank 0's values"
        )


def broadcast_replicas(scheduler: CommScheduler, state: list[tuple[str, torch.Tensor]]) -> None:
    """Give every rank rank 0's values of `state`."""
    with torch.no_grad():
        for _, tensor in state:
            data = tensor.data.contiguous()
            scheduler.broadcast(data.reshape(-1).view(torch.uint8))
            if data.data_ptr() != tensor.data.data_ptr():
                tensor.data.copy_(data)
