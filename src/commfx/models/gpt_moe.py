"""The built-in GPT-style MoE transformer: the default model for the demo and the tests.

It is small enough to train on a laptop CPU in seconds, yet has every feature the MoE
passes care about: a top-k softmax router (with a logit bias buffer, so tests can starve
an expert), experts stored as 3-D weights in F.linear layout, a SwiGLU expert FFN, and
causal attention. Its eager forward is written so dynamo captures it without graph
breaks (no data-dependent shapes: experts gather their weights per assignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTMoEConfig:
    vocab_size: int = 128
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 24
    max_seq: int = 64


class TopKRouter(nn.Module):
    """softmax over expert logits, keep the top k, renormalise them to sum to one."""

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.randn(config.num_experts, config.hidden_size) * 0.2)
        # Added to the logits; a large negative entry starves that expert (tests use it).
        self.register_buffer("logit_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight) + self.logit_bias
        probs = torch.softmax(logits, dim=-1)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


# torch's grouped matmul runs these on the CPU, eagerly (its fake kernel takes bfloat16 only, so a
# trace takes the per-row path); float64 (the equivalence tests') takes the per-row path too.
EXPERTS_IMPLEMENTATIONS = ("per_row", "grouped_mm")
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Experts(nn.Module):
    """E SwiGLU FFNs as 3-D weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]. Capturable
    and exportable (no data-dependent shapes); commfx's lift replaces it whole.

    `implementation` (as HF's experts implementations): "per_row" (default: any dtype and
    device, memory heavy) or "grouped_mm" (eager float32/16 on the CPU with widths of 16-byte
    multiples, the routed rows' FLOPs only; elsewhere per_row). The same function; float32 results differ in rounding."""

    implementation = "per_row"

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.expert_hidden
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * h**-0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * i**-0.5)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = indices.shape
        flat = indices.reshape(-1)
        tokens = x.repeat_interleave(k, dim=0)
        if self.implementation == "grouped_mm" and self._grouped_mm_runs(x) and not torch.compiler.is_compiling():
            out = self._grouped(tokens, flat)
        else:
            out = self._per_token(tokens, flat)
        out = out * weights.reshape(-1, 1).to(out.dtype)
        return out.view(n, k, -1).sum(dim=1)

    def _grouped_mm_runs(self, x: torch.Tensor) -> bool:
        """torch's grouped matmul takes CPU float32/16 rows whose widths are multiples of 16 bytes."""
        widths = (self.down_proj.shape[1], self.down_proj.shape[2])  # H, I
        return x.device.type == "cpu" and x.dtype in GROUPED_MM_DTYPES and all(w * x.element_size() % 16 == 0 for w in widths)

    def _grouped(self, tokens: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, each expert's rows through its weights in one grouped matmul
        (`torch._grouped_mm`), unsorted again: the FLOPs of the routed rows only."""
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(tokens[order], self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        return torch.empty_like(out).index_copy(0, order, out)

    def _per_token(self, tokens: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Each row through its expert's weights, gathered per row (any dtype, any device; memory
        heavy: a copy of the weights for every row)."""
        hidden = torch.bmm(self.gate_up_proj[flat], tokens.unsqueeze(-1)).squeeze(-1)
        gate, up = hidden.chunk(2, dim=-1)
        return torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)


class MoEBlock(nn.Module):
    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.router = TopKRouter(config)
        self.experts = Experts(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        x = h.reshape(-1, d)
        weights, indices = self.router(x)
        return self.experts(x, indices, weights).reshape(b, s, d)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.num_heads, d // self.num_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class DecoderLayer(nn.Module):
    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.ln_moe = nn.LayerNorm(config.hidden_size)
        self.moe = MoEBlock(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_attn(h))
        return h + self.moe(self.ln_moe(h))


class GPTMoE(nn.Module):
    """token ids [B, S] -> logits [B, S, vocab]."""

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_seq, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.ln_f(h))


def grouped_experts(model: nn.Module) -> None:
    """Run the model's built-in experts eagerly as one grouped matmul over the routed rows
    (`Experts.implementation = "grouped_mm"`) instead of the capturable per-row weight
    gather: the same function, without a copy of an expert's weights per routed row. A
    trace (dynamo) still records the capturable path."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.implementation = "grouped_mm"


def build_gpt_moe(
    *, seed: int = 0, batch: int = 8, seq: int = 16, dtype: torch.dtype = torch.float32, **overrides
) -> tuple[GPTMoE, tuple[torch.Tensor]]:
    """The model and a global batch of token ids, both determined by `seed`."""
    config = GPTMoEConfig(**overrides)
    if seq > config.max_seq:
        raise ValueError(f"seq={seq} exceeds max_seq={config.max_seq}; pass a larger max_seq")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPTMoE(config).to(dtype)
        input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    finally:
        torch.random.set_rng_state(generator_state)
    return model, (input_ids,)
