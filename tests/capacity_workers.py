"""What every rank runs for tests/test_capacity_reference.py (imported by the worker processes)."""

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan


def capacity_step(rank: int, world_size: int, factors: list[float], batch: int, starve_expert: int, probe: torch.Tensor) -> list[dict]:
    """One float64 forward and backward of gpt-moe under expert_parallel:capacity_factor=F on
    this rank's slice of the batch (loss = sum(output * probe)), for each factor F."""
    results = []
    for factor in factors:
        model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=batch)
        for layer in model.layers:
            layer.moe.router.logit_bias[starve_expert] = -1e4
        local = torch.tensor_split(ids, world_size)[rank]
        dm = distribute(model, Plan.from_cli(f"lift,expert_parallel:capacity_factor={factor}", world_size=world_size), (local,))
        output = dm(local)
        (output * torch.tensor_split(probe, world_size)[rank]).sum().backward()
        results.append(
            {
                "output": output.detach(),
                "grads": {n: p.grad.detach().clone() for n, p in dm.module.named_parameters() if p.grad is not None},
                "placement": dict(dm.placement),
            }
        )
    return results
