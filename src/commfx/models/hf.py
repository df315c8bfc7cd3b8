"""Tiny, randomly initialised Hugging Face (transformers v5) MoE causal LMs.

They give the compiler real-world MoE graphs (HF routers, HF ``@use_experts_implementation``
experts, shared experts, group-limited routing) without any download: only the config classes
and ``AutoModelForCausalLM.from_config`` are used, so everything runs offline in seconds.

Models are returned as transformers builds them (``*ForCausalLM``, KV cache on, the default
``grouped_mm`` experts): the doors take them so. What training and capture need is chosen
here, per model, by ``choose_experts_implementation`` (``batched_mm`` gathers expert weights
per (token, k) pair and applies them with ``bmm``: plain aten ops in any dtype, no
data-dependent shapes, so dynamo captures it ``fullgraph``; ``grouped_mm`` takes no float64
and the eager loop is a graph break) and ``training_forward`` (no KV cache).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# Shared by the DeepSeek-style families: 8 routed experts (top-2) plus one shared expert, MoE from
# the first layer on; and DeepSeek's multi-head latent attention, shrunk.
_GROUPED_EXPERTS = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0
)
# Qwen2-MoE and Qwen3-MoE share their MoE settings (tiny).
_QWEN_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
)
_MLA_ATTENTION = dict(
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4
)


__all__ = [
    "HF_DENSE_FAMILIES",
    "HF_FAMILIES",
    "HFFamily",
    "build_hf_moe",
    "build_hf_pretrained",
    "choose_experts_implementation",
    "hf_config",
    "is_hf_model",
    "training_forward",
]

# Shared tiny sizes. Token ids stay inside the vocabulary and no token is a padding index,
# so every embedding row is trained like any other.
_TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=1,
)


@dataclass(frozen=True)
class HFFamily:
    """How to build a tiny config for one HF ``model_type``.

    ``config`` overrides the shared tiny sizes; it must make every decoder layer an MoE layer and
    switch off anything random in the forward (router jitter, dropout). ``attn_implementation``
    is ``"sdpa"`` where the family supports it: one op in the graph, computed in the model dtype
    (the HF eager path does softmax in float32 and leaves a ``dropout(p=0)`` node in train mode).
    """

    config: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "sdpa"


HF_FAMILIES: dict[str, HFFamily] = {
    "mixtral": HFFamily(
        dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None)
    ),
    "qwen2_moe": HFFamily({**_QWEN_MOE, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": HFFamily({**_QWEN_MOE, "head_dim": 8}),
    "olmoe": HFFamily(dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16)),
    # 8 experts in 4 groups of 2, tokens may use 2 groups: group-limited routing really prunes.
    # The router's group score is the sum of the top-2 scores of a group, so groups need >= 2 experts.
    "deepseek_v3": HFFamily(dict(**_GROUPED_EXPERTS, n_group=4, topk_group=2, **_MLA_ATTENTION)),
    # Same router as deepseek_v3 (sigmoid scores, group-limited), ordinary GQA attention.
    "glm4_moe": HFFamily(dict(**_GROUPED_EXPERTS, n_group=4, topk_group=2, head_dim=8)),
    # Softmax scores, "group_limited_greedy": keep the group with the best expert (2 groups of 4).
    # A group's score is its best expert, so with top-2 experts only topk_group=1 ever prunes.
    "deepseek_v2": HFFamily(
        dict(**_GROUPED_EXPERTS, n_group=2, topk_group=1, topk_method="group_limited_greedy", **_MLA_ATTENTION)
    ),
    # Transposed, interleaved gate/up experts with biases and a clamped custom gate; attention sinks
    # (no sdpa support in HF, hence eager).
    "gpt_oss": HFFamily(
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=4,
            # HF's YaRN defaults, with the pre-YaRN context scaled so factor * it == max positions.
            rope_parameters=dict(
                rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                original_max_position_embeddings=2,
            ),
        ),
        attn_implementation="eager",
    ),
    # Router weight and correction bias kept in float32 by HF; shared experts; MoE from layer 0.
    "ernie4_5_moe": HFFamily(
        dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=1)
    ),
    # MoE lives at `block_sparse_moe` with its router at `.router`.
    "granitemoe": HFFamily(dict(num_local_experts=4, num_experts_per_tok=2)),
}


# Dense families (no experts): what tensor parallelism splits besides attention is the MLP.
# Qwen2 has biased q/k/v, Qwen3 per-head q/k norms, Llama grouped-query attention.
HF_DENSE_FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily(),
    "qwen2": HFFamily(dict(use_sliding_window=False)),
    "qwen3": HFFamily(dict(head_dim=8, use_sliding_window=False)),
    "mistral": HFFamily(dict(sliding_window=None)),
}


def _family(model_type: str) -> HFFamily:
    family = HF_FAMILIES.get(model_type) or HF_DENSE_FAMILIES.get(model_type)
    if family is None:
        raise _unknown(model_type)
    return family


def _unknown(model_type: str) -> ValueError:
    return ValueError(
        f"unknown HF model_type {model_type!r}; supported: {', '.join(sorted(HF_FAMILIES))} (MoE), "
        f"{', '.join(sorted(HF_DENSE_FAMILIES))} (dense). "
        "To add one, put an HFFamily(config overrides) entry in commfx.models.hf.HF_FAMILIES "
        "(tiny sizes, every layer MoE, no router jitter) and check that it captures fullgraph."
    )


def hf_config(model_type: str, **overrides):
    """The tiny transformers config for ``model_type`` (attention/experts implementations unset),
    with `overrides` given to the config's constructor (so fields derived from them follow)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**_TINY, **_family(model_type).config, **overrides})


def build_hf_moe(
    model_type: str,
    *,
    seed: int = 0,
    batch: int = 4,
    seq: int = 8,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Build a tiny random HF MoE causal LM, exactly as transformers returns it, and a global
    batch of token ids for it. `config_overrides` (`commfx ... --model-arg hidden_size=256`)
    set fields of the tiny config; a field the config does not have is an error.

    Weights are drawn in float32 from ``seed`` (the global RNG state is left untouched) and then
    converted to ``dtype``, so the float64 model holds exactly the float32 model's weights.
    The model is in train mode; with dropout and router jitter off its forward is deterministic.
    Its config is transformers' own (KV cache on, the default experts implementation): commfx's
    capture makes the choices training needs. Returns ``(model, (input_ids,))`` with
    ``input_ids`` of shape ``[batch, seq]``.
    """
    from transformers import AutoModelForCausalLM

    family = _family(model_type)
    tiny = hf_config(model_type)
    unknown = sorted(k for k in config_overrides if not hasattr(tiny, k))
    if unknown:
        raise ValueError(
            f"hf:{model_type}'s config has no {', '.join(unknown)}; --model-arg sets fields of {type(tiny).__name__} "
            f"(for example hidden_size, intermediate_size, num_attention_heads, num_hidden_layers, vocab_size)"
        )
    config = hf_config(model_type, **config_overrides)
    _check_routing(model_type, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=family.attn_implementation, dtype=torch.float32)
    model.to(dtype)
    model.config.dtype = dtype
    model.train()

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    return model, (input_ids,)


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # each family's name for the routed experts


def _check_routing(model_type: str, config) -> None:
    """A config whose tokens pick more experts than it has fails in every forward (torch's
    'k not in range'); said here, before any model is built or rank started."""
    experts = next((getattr(config, name) for name in _EXPERT_COUNTS if isinstance(getattr(config, name, None), int)), None)
    k = getattr(config, "num_experts_per_tok", None)
    if experts is not None and isinstance(k, int) and not 1 <= k <= experts:
        raise ValueError(
            f"hf:{model_type}: num_experts_per_tok={k} but the model has {experts} experts; each token picks 1 to {experts} "
            "of them: lower num_experts_per_tok or raise the experts (--model-arg)"
        )


# --------------------------------------------------- models exactly as transformers returns them

# Experts implementations that run every floating dtype on every device with plain aten ops
# (no data-dependent shapes, so dynamo captures them fullgraph). `grouped_mm` takes only
# float32/bfloat16/float16 matrices; `eager` loops over experts in Python (a graph break).
_ANY_DTYPE_EXPERTS = "batched_mm"
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_hf_model(model: torch.nn.Module) -> bool:
    """A transformers PreTrainedModel (or anything carrying a transformers config)."""
    config = getattr(model, "config", None)
    return config is not None and type(config).__module__.startswith("transformers.")


def experts_implementation_for(current: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """The experts implementation to run `dtype` on `device`, keeping `current` where it can.

    `grouped_mm` is kept for the dtypes its kernel takes on CUDA; everything else (float64,
    `eager`'s Python loop, unset) becomes `batched_mm`, which runs any dtype and captures
    as one graph.
    """
    if current == "grouped_mm" and device.type == "cuda" and dtype in _GROUPED_MM_DTYPES:
        return current
    if current == _ANY_DTYPE_EXPERTS:
        return current
    return _ANY_DTYPE_EXPERTS


def choose_experts_implementation(model: torch.nn.Module) -> str | None:
    """Set an HF model's experts implementation to one that runs its dtype and device.

    The choice never changes the function (every implementation computes the same experts),
    so it stays on the model: a float64 reference run of the same model then works too.
    Returns the implementation chosen (None for models without one). An HF model inside a
    module of the user's (a loss wrapper) is found: the outermost one is set.
    """
    model = next((m for m in model.modules() if is_hf_model(m) and hasattr(m, "set_experts_implementation")), None)
    if model is None:
        return None
    current = getattr(model.config, "_experts_implementation", None)
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    if parameter is None:
        return current
    wanted = experts_implementation_for(current, parameter.dtype, parameter.device)
    if wanted != current:
        try:
            model.set_experts_implementation(wanted)
        except ValueError:  # a model without experts: nothing to choose
            return current
    return wanted


@contextmanager
def training_forward(model: torch.nn.Module):
    """Inside this block an HF model's forward builds no KV cache (training needs none, and a
    cache is not a tensor a graph can return); the user's config is restored afterwards."""
    configs = [m.config for m in model.modules() if is_hf_model(m) and hasattr(m.config, "use_cache")]
    saved = [c.use_cache for c in configs]
    try:
        for c in configs:
            c.use_cache = False
        yield
    finally:
        for c, value in zip(configs, saved):
            c.use_cache = value


def build_hf_pretrained(
    directory: str, *, seed: int = 0, batch: int = 4, seq: int = 8, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A saved transformers causal LM (`save_pretrained`'s directory, e.g. what `commfx run
    --export DIR` writes) with its trained weights, local files only, and a batch of `batch` x
    `seq` token ids drawn from `seed`: a commfx run can start where another ended."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa")
    except (OSError, ValueError) as error:
        raise ValueError(f"{directory} does not load as a transformers causal LM: {error}") from None
    model.to(dtype)
    model.config.dtype = dtype
    model.train()
    generator = torch.Generator().manual_seed(seed)
    return model, (torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator),)

