"""Rank functions for tests/test_hf_compat.py (run by commfx.runtime.launcher.launch)."""

from __future__ import annotations

import torch

from commfx.models import load_model
from commfx.plan import Plan
from commfx.verify import split_batch


def compile_door_trains(rank: int, world_size: int, family: str, passes: str, steps: int, lr: float) -> dict:
    """A raw HF model (as transformers builds it) trained for `steps` SGD steps through
    torch.compile(model, backend=commfx.backend(plan, model=model)) with HF's own loss:
    each step's loss and the final parameters."""
    import commfx

    model, (ids,) = load_model(f"hf:{family}", dtype=torch.float64, batch=2 * world_size)
    local = split_batch(ids, world_size, rank)
    compiled = torch.compile(model, backend=commfx.backend(Plan.from_cli(passes, world_size=world_size), model=model))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(input_ids=local, labels=local).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
