"""A stream of batches for `commfx bench`: a different global batch every step, its token ids
drawn from Zipf's law over the model's vocabulary, the same for every rank and every plan.

EmbRace's 2D scheduling (`split_embedding_comm:schedule=2d`) sends first the embedding rows
the next batch reads, so it only has something to do when the next batch differs from this
one. Word frequencies follow Zipf's law (id k drawn with weight 1 / (k + 1)^s, the ids ranked
by frequency as in `benchmarks/embrace_models.py`), so a batch repeats the frequent rows as
text does and consecutive batches share them. Step `n`'s batch depends only on the seed and
`n`; each rank takes its share of it as it takes the model's example batch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from ..batches import batch_tensors

ZIPF_EXPONENT = 1.0  # s of Zipf's law; English words are close to 1
BATCH_MODES = ("auto", "stream", "fixed")
STREAM_PASS = "split_embedding_comm"  # plans with it get a stream under --batches auto (and every plan of their run)


@dataclass(frozen=True)
class BatchStream:
    """Global batches shaped like the model's example batch, token ids from Zipf's law."""

    vocab: int
    seed: int = 0
    exponent: float = ZIPF_EXPONENT

    def __post_init__(self):
        if self.vocab < 1:
            raise ValueError(f"a stream of batches needs a vocabulary of at least one id, got {self.vocab}")
        if self.exponent <= 0:
            raise ValueError(f"Zipf's exponent must be positive, got {self.exponent}")

    def batch(self, example, step: int):
        """Step `step`'s global batch: `example` (a tuple or a dict of tensors) with its token ids
        (its first integer tensor) drawn anew; an integer tensor holding those ids shifted by one
        (next-token labels) follows the new ids, its ignored (negative) labels kept; every
        other tensor is kept."""
        tensors = batch_tensors(example)
        at = next((i for i, t in enumerate(tensors) if _is_ids(t)), None)
        if at is None:
            raise ValueError("a stream of batches replaces the token ids, but the model's example batch has no integer tensor "
                             "with a sequence dimension; use --batches fixed")
        ids = tensors[at]
        windows = self._draw(step, (*ids.shape[:-1], ids.shape[-1] + 1)).to(ids.dtype)
        new = list(tensors)
        new[at] = windows[..., :-1].contiguous()
        for i, t in enumerate(tensors):
            if i != at and _are_labels_of(t, ids):
                new[i] = torch.where(t < 0, t, windows[..., 1:].to(t.dtype))
        return dict(zip(example, new)) if isinstance(example, dict) else tuple(new)

    def _draw(self, step: int, shape: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
        weights = torch.arange(1, self.vocab + 1, dtype=torch.float64).pow(-self.exponent)
        count = 1
        for size in shape:
            count *= size
        return torch.multinomial(weights, count, replacement=True, generator=generator).reshape(shape)

    def describe(self) -> str:
        return f"a new batch every step: token ids from Zipf's law (s={self.exponent:g}) over {self.vocab} ids, seed {self.seed}"


def _is_ids(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool and tensor.dim() >= 1


def _are_labels_of(tensor: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether `tensor` is `ids` shifted left by one where it is not ignored (negative)."""
    if not _is_ids(tensor) or tensor.shape != ids.shape or ids.shape[-1] < 2:
        return False
    labels, following = tensor[..., :-1], ids[..., 1:]
    kept = labels >= 0
    return bool(kept.any()) and bool((labels[kept] == following[kept]).all())


def model_vocabulary(model: nn.Module) -> int:
    """The rows token ids index: a config's `vocab_size` (the built-in and HF models, also
    inside a wrapper such as NextTokenLoss), else the largest `nn.Embedding` (the token table
    of a model file)."""
    for module in model.modules():
        vocab = getattr(getattr(module, "config", None), "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        raise ValueError("a stream of batches draws token ids from the model's vocabulary, but the model has no config.vocab_size "
                         "and no nn.Embedding; use --batches fixed")
    return max(tables)


def wants_stream(plans) -> bool:
    """Whether a run of these commfx plans gets a stream under --batches auto: one of them
    has split_embedding_comm (its peers in the run then get the same stream)."""
    return any(STREAM_PASS in plan.pass_names() for plan in plans)


def digest(batch) -> int:
    """A checksum of a batch's tensors (which batch a plan ran on, comparable across plans)."""
    value = 0
    for tensor in batch_tensors(batch):
        value = zlib.crc32(tensor.detach().contiguous().cpu().numpy().tobytes(), value)
    return value
