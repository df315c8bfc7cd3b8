"""A wide, shallow dense language model for pipeline benchmarks: hidden 1024, two residual
MLP blocks (one per stage at pp=2), byte vocabulary. Its compute per token (about 2 H^2
multiply-adds per block) is half of what a transformer layer spends on its attention
projections alone, so on a CPU the 100 Mbit/s link between stages carries a larger share
of a step and the backward sends are on its critical path.

    commfx bench benchmarks/models/wide_mlp_lm.py:build --pp 2 ...
"""

import torch
from torch import nn

HIDDEN, VOCAB, SEQ, BATCH, LAYERS = 1024, 256, 64, 64, 2


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class WideMLPLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build():
    return WideMLPLM(), (torch.randint(0, VOCAB, (BATCH, SEQ)),)
