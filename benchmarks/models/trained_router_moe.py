"""gpt-moe as in RESULTS section 5b, its routers trained on real text, for the expert-packing
benchmark: Lina's packing gains what a router's skew and co-selection give it, and an
untrained router has little of either.

    commfx bench benchmarks/models/trained_router_moe.py:build --passes ... --nodes 2 --ranks-per-node 1 ...

The model (2 layers, hidden 128, 8 experts top-2, expert hidden 1024, byte vocabulary) is
trained in one process for TRAIN_STEPS AdamW steps (lr 3e-3, seed 0) on consecutive 8 x 64
byte batches of `pydoc_data.topics` (DESIGN.md's corpus), with the usual load-balancing
auxiliary loss (Switch: ALPHA * E * sum_i f_i P_i), so the router learns skew and
co-selection without collapsing. The batch it returns is the next 32 x 64 bytes of the
corpus, text the training did not see. Training runs the experts expert by expert (the
reference model gathers a weight matrix per token, far too slow to train with) and takes a
few minutes on 2 cores, so the weights are cached under out/ (keyed by the settings) and
every rank and every later run loads them.
"""

import os
import types
import pydoc_data.topics
from pathlib import Path

import torch
import torch.nn.functional as F

from commfx.models import build_gpt_moe

CONFIG = dict(num_layers=2, hidden_size=128, num_heads=4, num_experts=8, top_k=2, expert_hidden=1024, vocab_size=256, max_seq=64)
SEQ, TRAIN_BATCH, TRAIN_STEPS, BATCH = 64, 8, 200, 32
ALPHA = 0.01
CACHE = Path(__file__).resolve().parents[2] / "out" / f"trained_router_moe_{TRAIN_STEPS}.pt"


def corpus_batches(count: int, batch: int) -> torch.Tensor:
    data = torch.tensor(list("".join(pydoc_data.topics.topics.values()).encode("utf-8")), dtype=torch.long)
    return data[: count * batch * SEQ].view(count, batch, SEQ)


def _experts_one_by_one(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Experts.forward's sum, computed per expert on the tokens that chose it."""
    out = torch.zeros_like(x)
    for expert in range(self.num_experts):
        token, slot = (indices == expert).nonzero(as_tuple=True)
        gate, up = (x[token] @ self.gate_up_proj[expert].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ self.down_proj[expert].t()
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def _balance_loss(router: torch.nn.Module, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Switch's auxiliary loss: E * sum_i (fraction of selections to i) * (mean probability of i)."""
    experts = router.weight.shape[0]
    probs = torch.softmax(F.linear(x, router.weight) + router.logit_bias, dim=-1)
    selected = torch.bincount(indices.reshape(-1), minlength=experts).to(probs.dtype) / indices.numel()
    return experts * (selected * probs.mean(0)).sum()


def trained_state(model: torch.nn.Module) -> dict:
    if CACHE.exists():
        return torch.load(CACHE, weights_only=True)
    torch.manual_seed(0)
    balance_terms = []
    hooks = [layer.moe.router.register_forward_hook(lambda router, args, out: balance_terms.append(_balance_loss(router, args[0], out[1])))
             for layer in model.layers]
    for layer in model.layers:
        layer.moe.experts.forward = types.MethodType(_experts_one_by_one, layer.moe.experts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, ids in enumerate(corpus_batches(TRAIN_STEPS, TRAIN_BATCH)):
        balance_terms.clear()
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        (loss + ALPHA * sum(balance_terms)).backward()
        optimizer.step()
        if step % 50 == 0:
            print(f"trained_router_moe: step {step}/{TRAIN_STEPS}, loss {loss.item():.3f}", flush=True)
    for hook in hooks:
        hook.remove()
    for layer in model.layers:
        del layer.moe.experts.forward
    print(f"trained_router_moe: {TRAIN_STEPS} steps, last loss {loss.item():.3f}; cached in {CACHE}")
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    partial = CACHE.with_suffix(f".{os.getpid()}.tmp")
    torch.save(model.state_dict(), partial)
    os.replace(partial, CACHE)  # atomic: a rank reading it never sees half a file
    return model.state_dict()


def build():
    model, _ = build_gpt_moe(seed=0, batch=1, seq=SEQ, **CONFIG)
    model.load_state_dict(trained_state(model))
    seen = TRAIN_STEPS * TRAIN_BATCH
    held_out = corpus_batches((seen + BATCH) // BATCH + 1, BATCH).view(-1, SEQ)[seen : seen + BATCH]
    return model, (held_out,)
