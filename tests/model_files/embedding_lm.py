"""A small untied language model with three embedding tables, for split_embedding_comm tests.

`tok` (nn.Embedding, 64 rows), `pos` (nn.Embedding over positions) and `kind` (a bare
parameter looked up with F.embedding and a padding row) feed one block and an untied head.
The batch's ids repeat, rows 40..63 of `tok` are used by no rank, and the first rows of the
batch (rank 0's share) only use ids below 16, so rank 0 asks no other shard for a row.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ = 64, 8, 6


class EmbeddingLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(2 * SEQ, WIDTH)
        self.kind = nn.Parameter(torch.randn(8, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(positions) + F.embedding(ids % 8, self.kind, padding_idx=0)
        return self.head(torch.tanh(self.mix(self.norm(h))))


def batch(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    first = rows // 2 + 1  # rank 0's share and more, at world 2 and 4: ids < 16 only
    low = torch.randint(0, 16, (first, SEQ), generator=generator)
    high = torch.randint(0, 40, (rows - first, SEQ), generator=generator)  # rows 40..63: never used
    return torch.cat([low, high])


def build(rows: int = 7):
    torch.manual_seed(0)
    return EmbeddingLM(), (batch(rows),)


def build_loss(rows: int = 7):
    """EmbeddingLM returning its own next-token loss (NextTokenLoss); the last position of
    every window has no next token, so its label is ignore_index (-100)."""
    from commfx.models import NextTokenLoss

    ids = batch(rows)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    torch.manual_seed(0)
    return NextTokenLoss(EmbeddingLM()), (ids, labels)


def build_loss_9():
    """build_loss on 9 rows (a model file for `commfx verify` at world 4: ranks of 3, 2, 2, 2)."""
    return build_loss(9)
