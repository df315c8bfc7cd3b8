"""A model that reads its embedding table late in the forward, for schedule=2d's simulation.

Each token's float features go through a stack of dense layers first; only then is the
token's row of a large untied table (`table`, an nn.Embedding) added and a small head
applied. Under split_embedding_comm:schedule=2d the table's row exchange can overlap the
dense layers of the next forward, which come before its lookup.
"""

import torch
from torch import nn

FEATURES, WIDTH, VOCAB, LAYERS, ROWS, SEQ = 32, 128, 4096, 4, 8, 64


class LateLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(FEATURES, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.table = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, features, ids):
        h = self.proj(features)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h + self.table(ids))


def build():
    torch.manual_seed(0)
    features = torch.randn(ROWS, SEQ, FEATURES)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    return LateLookup(), (features, ids)
