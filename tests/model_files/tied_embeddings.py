"""An HF Mixtral with tied input and output embeddings (tie_word_embeddings=True)."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build():
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
        max_position_embeddings=64, router_jitter_noise=0.0,
    )
    model = MixtralForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, (torch.randint(0, 64, (4, 8)),)
