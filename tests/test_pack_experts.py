"""pack_experts: each token goes to each rank once; lossless against the model in float64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commfx.ops  # noqa: F401
from commfx.passes import check_plan
from commfx.plan import Plan, PlanError
from commfx.verify import VerifyCase, verify

commfx_ops = torch.ops.commfx
MODEL_FILES = Path(__file__).parent / "model_files"
PACKED = "lift,expert_parallel,pack_experts"


def simulate(x, indices, weights, ranks, local_experts, expert_scale):
    """The packed block in one process: the all-to-alls are slices of the dispatched rows.
    Expert e multiplies its rows by expert_scale[e] (a stand-in FFN linear in its input)."""
    rows, meta, row_token, send = commfx_ops.rank_dispatch(x, indices, weights, ranks, local_experts)
    pieces = []
    for rank, (r_rows, r_meta) in enumerate(zip(rows.split(send.tolist()), meta.split(send.tolist()))):
        row_weights, local_ids = commfx_ops.split_meta(r_meta)
        laid, counts, slot = commfx_ops.masked_dispatch(r_rows, local_ids, local_experts)
        scale = expert_scale[rank * local_experts : (rank + 1) * local_experts].repeat_interleave(counts)
        pieces.append(commfx_ops.moe_combine(laid * scale.unsqueeze(1), slot, row_weights))
    return commfx_ops.scatter_add_tokens(torch.cat(pieces), row_token, x), send


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 9),
    ranks=st.sampled_from([1, 2, 4]),
    local_experts=st.integers(1, 3),
    k=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_rows_are_the_unique_token_rank_pairs_and_the_sum_is_exact(tokens, ranks, local_experts, k, seed):
    experts = ranks * local_experts
    k = min(k, experts)
    generator = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    x = torch.randn(tokens, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weights = torch.rand(tokens, k, dtype=torch.float64, generator=generator, requires_grad=True)
    scale = torch.rand(experts, dtype=torch.float64, generator=generator) + 0.5
    out, send = simulate(x, indices, weights, ranks, local_experts, scale)
    owners = indices // local_experts
    assert int(send.sum()) == sum(len(set(row.tolist())) for row in owners)  # the minimum for this placement
    expected = (weights.unsqueeze(-1) * scale[indices].unsqueeze(-1) * x.unsqueeze(1)).sum(1)
    assert (out - expected).abs().max() <= 1e-12
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (x, weights))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (x, weights))
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max() <= 1e-12


@pytest.mark.distributed
def test_packed_expert_parallel_equals_the_model():
    """World 2: top-1, top-2 (uneven batch) and top-4, HF Mixtral, and a rank that receives no
    token rows at all. Outputs and every gradient (router weights included) <= 1e-10."""
    plan = Plan.from_cli(PACKED, world_size=2)
    cases = [
        VerifyCase(f"{MODEL_FILES / 'routing.py'}:top1", plan),
        VerifyCase("gpt-moe", plan, batch=3),
        VerifyCase(f"{MODEL_FILES / 'routing.py'}:top4", plan),
        VerifyCase("hf:mixtral", plan, batch=3),
        VerifyCase(f"{MODEL_FILES / 'routing.py'}:rank0_starved", plan),
    ]
    for case, report in zip(cases, verify(cases, 2, timeout_s=600)):
        assert report.ok, (case.model, report.failures, report.max_diff)
        assert any("router" in name or "gate" in name for name in report.grad_diffs), "router gradients are compared"


@pytest.mark.distributed
def test_packed_expert_parallel_equals_the_model_at_world_4():
    (report,) = verify([VerifyCase("gpt-moe", Plan.from_cli(PACKED, world_size=4), batch=6)], 4, timeout_s=600)
    assert report.ok, (report.failures, report.max_diff)


@pytest.mark.distributed
def test_packing_sends_fewer_rows_than_plain_expert_parallel():
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    plain, packed = (launch("dist_workers:dispatch_rows", 2, {"passes": p}, timeout_s=300) for p in ("lift,expert_parallel", PACKED))
    for plain_rank, packed_rank in zip(plain, packed):
        assert plain_rank["tokens"] == packed_rank["tokens"]
        # Plain: one row per (token, expert); packed: one per (token, rank), the unique minimum.
        assert plain_rank["dispatch_rows"] == 2 * plain_rank["tokens"] * 2  # 2 layers x tokens x top-2
        assert packed_rank["dispatch_rows"] == packed_rank["unique_token_rank_pairs"] < plain_rank["dispatch_rows"]


@pytest.mark.parametrize(
    "passes, message",
    [
        ("lift,pack_experts", "needs expert_parallel before it; for example --passes lift,expert_parallel,pack_experts"),
        ("lift,expert_parallel,partition_a2a,pack_experts", "does not compose with partition_a2a yet"),
        ("lift,expert_parallel:capacity_factor=1.25,pack_experts", "needs dropless expert parallelism"),
    ],
)
def test_plans_pack_experts_cannot_run_are_clear_errors(passes, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_plan(Plan.from_cli(passes, world_size=2))
