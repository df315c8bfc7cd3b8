"""Capacity-mode expert parallelism against an eager reference that shares no commfx code.

The reference is written here from the documented semantics (README, "Capacity mode and
dropped tokens"): each rank routes its own slice of the batch; every expert takes at most
C = max(1, ceil(F * tokens * k / experts)) of the rank's assignments, first come first
served in token order; a dropped assignment adds nothing and the token's other routing
weights are not renormalised, so a token with every assignment dropped is carried by the
residual alone. Gradients are averaged over the ranks (mean reduction), as data parallelism
does. commfx's own check (`commfx.verify`) builds its capacity reference from commfx's
`lift` and `set_capacity`; this one does not, so a shared mistake cannot hide.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from commfx.models import load_model
from commfx.runtime.launcher import launch

pytestmark = pytest.mark.distributed
TESTS = str(Path(__file__).parent)

WORLD = 2
BATCH = 5  # 3 and 2 sequences of 16 tokens: uneven tokens per rank, so uneven capacities
STARVED = 3  # an expert no token picks
FACTORS = [0.5, 1.3]  # heavy dropping; light dropping with C = ceil(15.6) and ceil(10.4)
TOLERANCE = 1e-10


def capacity_moe(block, h: torch.Tensor, factor: float, dropped: list[int]) -> torch.Tensor:
    """The MoE block on one rank's tokens with capacity `factor`, in plain torch, one
    assignment at a time; appends the number of dropped assignments to `dropped`."""
    router, experts = block.router, block.experts
    b, s, d = h.shape
    x = h.reshape(-1, d)
    n, k, num_experts = x.shape[0], router.top_k, router.weight.shape[0]
    probs = torch.softmax(x @ router.weight.T + router.logit_bias, dim=-1)
    top, chosen = torch.topk(probs, k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True)  # normalised before dropping, never after
    capacity = max(1, math.ceil(factor * n * k / num_experts))
    taken = [0] * num_experts
    outputs, drops = [], 0
    for t in range(n):
        total = x.new_zeros(d)
        for j in range(k):
            e = int(chosen[t, j])
            if taken[e] == capacity:
                drops += 1
                continue
            taken[e] += 1
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            total = total + weights[t, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
        outputs.append(total)
    dropped.append(drops)
    return torch.stack(outputs).reshape(b, s, d)


def reference(factor: float, probe: torch.Tensor):
    """(output, gradients, dropped assignments per rank and layer) of the eager capacity model."""
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=BATCH)
    dropped: list[int] = []
    for layer in model.layers:
        layer.moe.router.logit_bias[STARVED] = -1e4
        layer.moe.forward = lambda h, block=layer.moe: capacity_moe(block, h, factor, dropped)
    output = torch.cat([model(part) for part in torch.tensor_split(ids, WORLD)])
    ((output * probe).sum() / WORLD).backward()
    return output.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, dropped


def test_capacity_mode_equals_an_independent_eager_reference():
    sys.path.insert(0, TESTS)
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=BATCH)
    probe = torch.randn((*ids.shape, model.config.vocab_size), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ranks = launch(
        "capacity_workers:capacity_step",
        WORLD,
        {"factors": FACTORS, "batch": BATCH, "starve_expert": STARVED, "probe": probe},
        timeout_s=300,
    )
    for i, factor in enumerate(FACTORS):
        output, grads, dropped = reference(factor, probe)
        assert sum(dropped) > 0, f"capacity_factor={factor} drops nothing here, so this case tests nothing"
        results = [rank[i] for rank in ranks]
        distributed = torch.cat([r["output"] for r in results])
        assert (distributed - output).abs().max().item() <= TOLERANCE, f"capacity_factor={factor}: outputs differ"
        assert set(results[0]["grads"]) == set(grads), f"capacity_factor={factor}: gradients present on one side only"
        sharded = set()
        for name, expected in grads.items():
            for rank, result in enumerate(results):
                start, stop = result["placement"].get(name, (0, expected.shape[0]))  # expert shards: [start, stop)
                if name in result["placement"]:
                    sharded.add(name)
                difference = (result["grads"][name] - expected[start:stop]).abs().max().item()
                assert difference <= TOLERANCE, f"capacity_factor={factor}: {name} on rank {rank} differs by {difference:.3g}"
        assert any("experts" in name for name in sharded), "expert weights should be sharded over the ranks"
