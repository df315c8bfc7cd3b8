"""The experts' GEMMs compute in the precision asked for (issue 42, item 1): a bf16 plan's
grouped GEMMs get bf16 rows and weights whichever HF experts implementation was captured
(CUDA keeps `grouped_mm`, whose graph op the precision transform must recognise), and
commfx's compute ops follow `torch.autocast` (the torch.compile door)."""

from __future__ import annotations

import collections

import pytest
import torch

import commfx
import commfx.models.hf as hf
import commfx.ops.moe as moe
import commfx.ops.packed as packed
from commfx.compiler.pipeline import compile_program
from commfx.models import load_model
from commfx.plan import PassSpec, Plan, Topology
from commfx.runtime.comm import active, local_scheduler

ops = torch.ops.commfx


@pytest.fixture
def gemm_dtypes(monkeypatch):
    """Every grouped GEMM the expert ops run, as (kernel, rows dtype, weights dtype)."""
    seen: collections.Counter = collections.Counter()
    for module, names in ((moe, ("grouped_mm", "grouped_mm_weight_grad")), (packed, ("grouped_mm", "packed_experts"))):
        for name in names:
            original = getattr(module, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                weights = args[4] if _name == "packed_experts" else args[1]
                seen[(_name, args[0].dtype, weights.dtype)] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return seen


def test_hf_grouped_mm_experts_compute_in_the_plans_dtype(monkeypatch, gemm_dtypes):
    """HF's `grouped_mm` experts (what capture keeps on CUDA) trace as a library op, not a
    torch matmul; the bf16 plan must still cast their rows, so every expert GEMM of a world-1
    step, forward and backward, runs in bf16, and no all-to-all runs for the group of one."""
    monkeypatch.setattr(hf, "experts_implementation_for", lambda current, dtype, device: "grouped_mm")
    model, inputs = load_model("hf:mixtral")
    plan = Plan(Topology(1), (PassSpec("lift"), PassSpec("expert_parallel")), precision="bf16")
    program = compile_program(model, plan, inputs)
    assert model.config._experts_implementation == "grouped_mm"
    scheduler = local_scheduler()
    with active(scheduler):
        out = program.gm(*inputs)[0]
        out.float().square().mean().backward()
    assert gemm_dtypes and set(k[1:] for k in gemm_dtypes) == {(torch.bfloat16, torch.bfloat16)}, gemm_dtypes
    assert {name for name, _, _ in gemm_dtypes} == {"grouped_mm", "grouped_mm_weight_grad"}
    assert not scheduler.stats.calls, "a group of one rank runs no collective"
    grads = {p.grad.dtype for p in program.gm.parameters() if p.grad is not None}
    assert grads == {torch.float32}, "the masters' gradients stay float32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_reaches_the_expert_ops(dtype, gemm_dtypes):
    """Under torch.autocast, expert_ffn, packed_expert_ffn and the dispatches compute in the
    autocast's dtype (not one fixed at registration); float32 masters get float32 gradients,
    the routing weights keep their dtype, and float64 is never cast."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    gate_up = torch.randn(2, 10, 8, generator=g, requires_grad=True)
    down = torch.randn(2, 8, 5, generator=g, requires_grad=True)
    counts = torch.tensor([4, 2])
    local_ids = torch.tensor([[0, 1], [1, -1], [0, -1], [-1, 1], [0, 1], [1, 0]])
    weights = torch.rand(6, 2, generator=g, requires_grad=True)
    indices = torch.tensor([[0, 1], [1, 0], [0, 1]])
    with torch.autocast("cpu", dtype):
        y = ops.expert_ffn(x, counts, gate_up, down, "silu")
        z = ops.packed_expert_ffn(x, local_ids, weights, gate_up, down, "silu")
        rows = ops.moe_dispatch(x[:3], indices, 2, 0.0)[0]
        sent = ops.rank_dispatch(x[:3], indices, weights[:3], 2, 1)
    assert y.dtype == z.dtype == rows.dtype == sent[0].dtype == dtype
    assert sent[1].dtype == torch.float32, "routing weights are not cast"
    (y.float().sum() + z.float().sum() + rows.float().sum()).backward()
    assert {t.grad.dtype for t in (x, gate_up, down, weights)} == {torch.float32}
    assert set(k[1:] for k in gemm_dtypes) == {(dtype, dtype)}, gemm_dtypes
    with torch.autocast("cpu", dtype):
        assert ops.expert_ffn(x.double(), counts, gate_up.double(), down.double(), "silu").dtype == torch.float64


def test_the_compile_door_under_autocast_computes_experts_in_bf16(gemm_dtypes):
    """torch.compile with commfx's backend inside torch.autocast: the lifted experts' GEMMs
    (forward and backward) run in bf16, as the unlifted model's linears would."""
    model, (ids,) = load_model("gpt-moe-tiny")
    plan = Plan.from_cli("lift,expert_parallel", world_size=1)
    forward = torch.compile(model, backend=commfx.backend(plan, model=model))
    with torch.autocast("cpu", torch.bfloat16):
        out = forward(ids)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    assert gemm_dtypes and set(k[1:] for k in gemm_dtypes) == {(torch.bfloat16, torch.bfloat16)}, gemm_dtypes
    assert {name for name, _, _ in gemm_dtypes} == {"grouped_mm", "grouped_mm_weight_grad"}
