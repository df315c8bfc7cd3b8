"""gpt-moe-tiny whose attention weights differ on rank 1 only (by PERTURBATION, relative): a
real bug that verify must catch under mixed precision too, where its tolerance is bf16's."""

import os

import torch
import torch.distributed as dist

from commfx.models import load_model

PERTURBATION = float(os.environ.get("COMMFX_TEST_PERTURBATION", "0.02"))


def build():
    model, inputs = load_model("gpt-moe-tiny")
    if dist.is_initialized() and dist.get_rank() == 1:
        with torch.no_grad():
            model.layers[0].attn.qkv.weight.mul_(1 + PERTURBATION)
    return model, inputs
