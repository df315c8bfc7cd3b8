"""A model file for the commfx CLI: a Hugging Face MoE model exactly as transformers builds it.

    commfx verify examples/hf_moe_model.py:build --world-size 2
    commfx run examples/hf_moe_model.py:build --world-size 2 --steps 3

`build()` returns (model, example_inputs); the example inputs are the global batch, which
commfx splits along dim 0 over the ranks. Random weights from a small config: nothing is
downloaded.
"""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def build():
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(config)
    input_ids = torch.randint(0, config.vocab_size, (4, 16))
    return model, (input_ids,)
