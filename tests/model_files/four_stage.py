"""Models deep enough for four pipeline stages: the built-in gpt-moe with four layers (one
per stage), and the tied language model with four blocks (the embedding on stage 0 and the
tied head on stage 3)."""

import sys
from pathlib import Path

import torch

from commfx.models import build_gpt_moe

sys.path.insert(0, str(Path(__file__).parent))
from tied_pipeline import TiedLM  # noqa: E402


def gpt_moe():
    return build_gpt_moe(
        num_layers=4, hidden_size=16, num_heads=2, num_experts=4, expert_hidden=12, vocab_size=32, batch=4, seq=6
    )


def tied():
    model = TiedLM(layers=4)
    return model, (torch.randint(0, 32, (4, 6)),)
