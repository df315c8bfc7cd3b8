"""A small dense language model whose output head is tied to its input embedding: with
pp=2 the first and the last stage both hold the weight, and its gradient is the sum."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build():
    model = TiedLM()
    return model, (torch.randint(0, 32, (4, 6)),)
