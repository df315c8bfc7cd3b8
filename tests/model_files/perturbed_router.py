"""A DeepSeek-V3 model whose router differs on rank 1 only: a real bug inside a region the
model computes in float32, which verify must still catch."""

import torch
import torch.distributed as dist

from commfx.models.hf import build_hf_moe


def build():
    model, inputs = build_hf_moe("deepseek_v3", batch=4, seq=8)
    if dist.is_initialized() and dist.get_rank() == 1:
        with torch.no_grad():
            model.model.layers[0].mlp.gate.weight.mul_(1.05)
    return model, inputs
