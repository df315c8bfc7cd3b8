"""Built-in MoE models with other routings, for the packing tests (float32; verify casts)."""

import torch

from commfx.models import build_gpt_moe


def top1():
    return build_gpt_moe(top_k=1, num_experts=4, batch=5, seed=1)


def top4():
    return build_gpt_moe(top_k=4, num_experts=8, batch=5, seed=2)


def rank0_starved():
    """Experts 0-3 (rank 0's half at ep=2) are never chosen: rank 0 receives no token rows."""
    model, inputs = build_gpt_moe(num_experts=8, batch=4, seed=3)
    with torch.no_grad():
        for layer in model.layers:
            layer.moe.router.logit_bias[:4] = -1e4
    return model, inputs
