"""benchmarks/embrace_models.py: the EmbRace step-time models load through the model-file door,
have an untied 50k vocabulary, and see word ids with real text's frequencies."""

from pathlib import Path

import torch

from commfx.models import load_model

FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "embrace_models.py"


def _check_words(ids: torch.Tensor) -> None:
    assert ids.shape == (16, 64) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < 50_000
    # Real text: a few hundred distinct words per batch (uniform ids would give ~1,000 of 1,024),
    # and most tokens among the 1,000 most frequent words (uniform: 2%).
    assert ids.unique().numel() < 600
    assert (ids < 1000).float().mean() > 0.7


def test_gpt_moe_words_untied_50k_on_word_ids():
    model, (ids,) = load_model(f"{FILE}:gpt_moe_words")
    _check_words(ids)
    tables = {n: p for n, p in model.named_parameters() if p.shape[0] == 50_000}
    assert len(tables) == 2, f"expected an input table and an untied head of 50,000 rows, got {sorted(tables)}"
    first, second = tables.values()
    assert first.data_ptr() != second.data_ptr()
    again, (same,) = load_model(f"{FILE}:gpt_moe_words")
    assert torch.equal(ids, same), "the batch must be the same for every plan of one bench run"
    assert model(ids).shape == (16, 64, 50_000)


def test_olmoe_words_untied_50k():
    model, (ids,) = load_model(f"{FILE}:olmoe_words")
    _check_words(ids)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.shape == head.shape == (50_000, 64)
    assert embed.data_ptr() != head.data_ptr()
    assert model(input_ids=ids[:2]).logits.shape == (2, 64, 50_000)
