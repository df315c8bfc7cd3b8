"""Embedding-heavy models on real word ids, for `commfx bench` and the EmbRace figures.

Each function returns ``(model, (input_ids,))`` as a model file for any commfx door
(``commfx bench benchmarks/embrace_models.py:gpt_moe_words``): an untied 50,000-word
vocabulary and a global batch of word ids from Python's own documentation
(``pydoc_data.topics``). Ids are the words ranked by frequency (0 the most frequent), the
rarer ones folded into one unknown id, so a batch touches rows as real text does: a few
hundred distinct rows of 50,000, most of them near the top of the table.

The batch is 16 windows of 64 consecutive words at seeded random offsets (8 per rank at
world size 2); the same batch every step, as for every `commfx bench` model.
"""

from __future__ import annotations

import collections
import re

import torch

VOCAB, HIDDEN, SEQ, ROWS = 50_000, 64, 64, 16


def corpus_ids(vocab: int = VOCAB) -> torch.Tensor:
    """Every word and punctuation mark of pydoc_data.topics as an id ranked by frequency."""
    import pydoc_data.topics

    words = re.findall(r"\w+|[^\w\s]", " ".join(pydoc_data.topics.topics.values()).lower())
    ranked = [w for w, _ in collections.Counter(words).most_common(vocab - 1)]
    index = {w: i for i, w in enumerate(ranked)}
    return torch.tensor([index.get(w, vocab - 1) for w in words])


def word_batch(rows: int = ROWS, seq: int = SEQ, seed: int = 0, ids: torch.Tensor | None = None) -> torch.Tensor:
    """`rows` windows of `seq` consecutive word ids at random offsets (seeded)."""
    ids = corpus_ids() if ids is None else ids
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq, (rows,), generator=generator)
    return torch.stack([ids[s : s + seq] for s in starts.tolist()])


def gpt_moe_words():
    """The built-in gpt-moe (hidden 64, 2 layers, 4 experts top-2) with an untied 50k vocabulary."""
    from commfx.models import build_gpt_moe

    model, _ = build_gpt_moe(vocab_size=VOCAB, hidden_size=HIDDEN, num_experts=4, expert_hidden=64, max_seq=SEQ)
    return model, (word_batch(),)


def gpt_moe_words_loss():
    """gpt_moe_words returning its own next-token loss (`commfx.models.NextTokenLoss`): the
    logits stay inside the forward, so split_embedding_comm can split the 50k LM head over
    the vocabulary. The batch: the same 16 windows, one word longer, as (input ids, labels)."""
    from commfx.models import NextTokenLoss, build_gpt_moe, shifted

    model, _ = build_gpt_moe(vocab_size=VOCAB, hidden_size=HIDDEN, num_experts=4, expert_hidden=64, max_seq=SEQ)
    return NextTokenLoss(model), shifted(word_batch(seq=SEQ + 1))


def olmoe_words():
    """HF OLMoE (transformers' own modelling code, randomly initialised): hidden 64, 2 layers,
    4 experts top-2, untied 50k vocabulary."""
    return _olmoe(), (word_batch(),)


def olmoe_words_loss():
    """olmoe_words returning its own next-token loss (NextTokenLoss over the HF model's logits)."""
    from commfx.models import NextTokenLoss, shifted

    return NextTokenLoss(_olmoe()), shifted(word_batch(seq=SEQ + 1))


def _olmoe():
    from transformers import AutoModelForCausalLM

    from commfx.models.hf import hf_config

    config = hf_config("olmoe")
    config.vocab_size, config.hidden_size, config.max_position_embeddings = VOCAB, HIDDEN, SEQ
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    return model


# GPT-2 small (Radford et al. 2019; its published config): vocabulary 50,257, hidden 768, 12 layers,
# MLP 4 x hidden, learned positions, the LM head tied to the token table.
GPT2_VOCAB, GPT2_HIDDEN, GPT2_LAYERS = 50_257, 768, 12
GPT2_SCALED_HIDDEN = 128


def gpt2_words_loss():
    """GPT-2 small's proportions scaled to hidden 128: the same vocabulary ÷ hidden ratio (65.4,
    so 8,377 words), 12 layers, MLP of GPT-2's 8 × hidden² parameters (gpt-moe's gated MoE block of one expert, 344 ≈ 8/3 × hidden wide, which
    its router weights 1.0), learned positions, the LM head TIED to the token table; returning
    its own next-token loss on the word windows of gpt_moe_words_loss (rarer words folded
    into one id). Embedding and head hold 31% of the parameters, as in GPT-2 small."""
    from commfx.models import NextTokenLoss, build_gpt_moe, shifted

    vocab = round(GPT2_VOCAB / GPT2_HIDDEN * GPT2_SCALED_HIDDEN)
    model, _ = build_gpt_moe(vocab_size=vocab, hidden_size=GPT2_SCALED_HIDDEN, num_layers=GPT2_LAYERS, num_heads=4,
                             num_experts=1, top_k=1, expert_hidden=344, max_seq=SEQ + 1)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model.embed.weight.normal_(0.0, 0.02)  # GPT-2's initialisation of its (tied) token table
    model.lm_head.weight = model.embed.weight
    return NextTokenLoss(model), shifted(word_batch(seq=SEQ + 1, ids=corpus_ids(vocab)))


# Issue 44's word LM: Llama-style, untied, a 50,000-word vocabulary at hidden 384 and 4 layers,
# so the token table and the head hold 84% of the parameters (EmbRace's LMs are embedding-bound).
WORD_LM = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6)


def llama_words_loss():
    """HF Llama (transformers' own modelling code, randomly initialised) at WORD_LM's sizes with
    an untied 50k vocabulary, returning its next-token loss."""
    from transformers import AutoModelForCausalLM

    from commfx.models import NextTokenLoss, shifted
    from commfx.models.hf import hf_config

    config = hf_config("llama")
    for key, value in WORD_LM.items():
        setattr(config, key, value)
    config.head_dim = WORD_LM["hidden_size"] // WORD_LM["num_attention_heads"]
    config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings = VOCAB, SEQ + 1, False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    return NextTokenLoss(model), shifted(word_batch(seq=SEQ + 1))
