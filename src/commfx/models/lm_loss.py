"""A language model that returns its own next-token loss, as training code often writes it.

`NextTokenLoss(lm)(input_ids, labels)` is `F.cross_entropy(lm(input_ids).flatten(0, 1),
labels.flatten())` (an HF CausalLM's `.logits` taken from its output): the logits never leave the forward, so `split_embedding_comm` can split
the LM head over the vocabulary (head=shard) and its dense gradient is never all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class NextTokenLoss(nn.Module):
    def __init__(self, lm: nn.Module, ignore_index: int = -100):
        super().__init__()
        self.lm = lm
        self.ignore_index = ignore_index

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids)
        logits = getattr(logits, "logits", logits)  # an HF model's ModelOutput
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index)


def shifted(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) of next-token prediction from windows one token longer."""
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
