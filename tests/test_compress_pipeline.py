"""Optimus-CC's compressed backward traffic: exact where theory says so, bounded where not.

- a boundary gradient of rank <= r is rebuilt exactly; r at full rank equals uncompressed;
- lazy error propagation: after t sends, sum(sent) = sum(true) - E_t exactly, with
  ||E_t|| <= ||M_t + E_{t-1}|| (one residual behind, not the sum of all residuals);
- end to end on gloo ranks: full-rank compression (with the fused tied-embedding sync)
  equals the single-process model in float64; a rank-2 run sends the bytes the factors
  take; the codec state survives a state_dict round trip;
- the Triton kernels equal their torch references under TRITON_INTERPRET=1.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commfx.compiler.pipeline import compile_program
from commfx.kernels.powersgd import lowrank_residual_reference, orthogonalize_reference
from commfx.models import load_model
from commfx.ops.compress import LowRankCodec
from commfx.compiler.pass_manager import check_plan
from commfx.plan import Plan, PlanError
from commfx.runtime.launcher import launch
from commfx.verify import VerifyCase, verify

TESTS = Path(__file__).parent
TIED = f"{TESTS / 'model_files' / 'tied_pipeline.py'}:build"


def roundtrip(codec, grads, state=None, critical=True):
    state = {} if state is None else state
    specs = [(g.shape, g.dtype) for g in grads]
    payload = codec.encode([g.clone() for g in grads], state, critical)
    assert [(p.shape, p.dtype) for p in payload] == codec.payload_specs(specs, critical)
    return codec.decode(payload, specs, critical), payload, state


@pytest.mark.parametrize("tokens,hidden,true_rank,r", [(24, 16, 2, 4), (24, 16, 4, 4), (10, 30, 1, 8), (6, 4, 3, 3)])
def test_low_rank_gradient_is_rebuilt_exactly(tokens, hidden, true_rank, r):
    generator = torch.Generator().manual_seed(tokens * hidden + r)
    m = torch.randn(tokens, true_rank, generator=generator, dtype=torch.float64) @ torch.randn(
        true_rank, hidden, generator=generator, dtype=torch.float64
    )
    grad = m.view(2, tokens // 2, hidden)  # [micro-batch rows, seq, hidden] viewed as [tokens, hidden]
    (rebuilt,), payload, _ = roundtrip(LowRankCodec(r, error_feedback=False), [grad])
    assert (rebuilt - grad).abs().max().item() <= 1e-12 * max(1.0, grad.abs().max().item())
    assert [tuple(p.shape) for p in payload] == [(tokens, min(r, tokens, hidden)), (hidden, min(r, tokens, hidden))]


def test_full_rank_equals_uncompressed():
    grad = torch.randn(3, 4, 16, dtype=torch.float64)  # [12, 16]: rank 12 at most
    (rebuilt,), _, state = roundtrip(LowRankCodec(16), [grad])
    assert (rebuilt - grad).abs().max().item() <= 1e-12
    assert state["error.0"].abs().max().item() <= 1e-12


def test_lazy_error_propagation_tracks_the_true_sum():
    """sum of sent gradients = sum of true gradients - E_t, and ||E_t|| <= ||M_t + E_{t-1}||.

    Gradients of rank 4 (persisting across micro-batches) plus noise, sent at rank 2: with
    feedback the running sum stays one residual behind; without, the dropped directions
    pile up every step."""
    generator = torch.Generator().manual_seed(7)
    signal = torch.randn(32, 4, generator=generator, dtype=torch.float64) @ torch.randn(4, 16, generator=generator, dtype=torch.float64)
    grads = [signal + 0.1 * torch.randn(32, 16, generator=generator, dtype=torch.float64) for _ in range(30)]
    drift = {}
    for error_feedback in (True, False):
        codec, state = LowRankCodec(2, error_feedback=error_feedback), {}
        sent_sum, true_sum, previous_error = torch.zeros(32, 16, dtype=torch.float64), torch.zeros(32, 16, dtype=torch.float64), None
        for m in grads:
            (sent,), _, state = roundtrip(codec, [m], state)
            sent_sum += sent
            true_sum += m
            if error_feedback:
                error = state["error.0"]
                assert (true_sum - sent_sum - error).abs().max().item() <= 1e-10  # exactly one residual behind
                corrected = m + (previous_error if previous_error is not None else 0)
                assert error.norm() <= corrected.norm() * (1 + 1e-12)
                previous_error = error.clone()
        drift[error_feedback] = (true_sum - sent_sum).norm().item()
    # Without error feedback every step's residual stays in the sum; with it, only the last.
    assert drift[True] * 5 < drift[False]


def test_epilogue_only_sends_the_rest_exactly_and_clears_the_residual():
    codec = LowRankCodec(2)  # epilogue only
    m = torch.randn(8, 6, dtype=torch.float64)
    _, payload, state = roundtrip(codec, [m], critical=True)
    assert len(payload) == 2 and "error.0" in state
    residual = state["error.0"].clone()
    (sent,), payload, state = roundtrip(codec, [m], state, critical=False)
    assert len(payload) == 1 and "error.0" not in state
    assert (sent - (m + residual)).abs().max().item() <= 1e-15
    assert LowRankCodec(2, epilogue_only=False).compresses(False)  # every send


def test_plan_errors():
    model, _ = load_model("gpt-moe")
    with pytest.raises(PlanError, match="pass .compress_pipeline. needs pipeline_split before it"):
        check_plan(Plan.from_cli("lift,compress_pipeline", world_size=2, pp=2), model)
    with pytest.raises(PlanError, match="rank must be at least 1"):
        check_plan(Plan.from_cli("lift,pipeline_split,compress_pipeline:rank=0", world_size=2, pp=2), model)
    with pytest.raises(PlanError, match=r"boundaries='3': write 'all', 'none' or indices joined by '\+' from 0 to 0"):
        check_plan(Plan.from_cli("lift,pipeline_split,compress_pipeline:boundaries=3", world_size=2, pp=2), model)


def test_boundaries_carry_the_codec():
    model, inputs = load_model("gpt-moe")
    program = compile_program(model, Plan.from_cli("lift,pipeline_split,compress_pipeline:rank=4", world_size=2, pp=2), inputs)
    pipeline = program.regions.pipeline
    assert str(pipeline.boundaries[0].codec) == "PowerSGD rank 4, lazy error propagation, epilogue sends only"
    assert "backward codec PowerSGD rank 4" in pipeline.describe()


# ------------------------------------------------------------------------ gloo ranks


@pytest.mark.distributed
def test_full_rank_compression_and_fused_embedding_sync_are_exact():
    plan = Plan.from_cli("lift,pipeline_split,compress_pipeline:rank=16;epilogue_only=false", world_size=2, pp=2)
    (report,) = verify([VerifyCase(TIED, plan)], 2, timeout_s=300)
    assert report.ok and report.max_diff <= 1e-10, (report.failures, report.max_diff)
    assert "embed.weight" in report.grad_diffs


@pytest.mark.distributed
def test_compressed_bytes_and_codec_state_checkpoint():
    sys.path.insert(0, str(TESTS))
    passes = "lift,pipeline_split,compress_pipeline:rank=2;epilogue_only=false"
    results = launch("pipeline_workers:checkpoint_codec_state", 2, {"passes": passes}, timeout_s=300)
    first, last = results
    # gpt-moe, batch 4 x seq 8, hidden 32, 2 micro-batches of [2, 8, 32] = [16 tokens, 32] in float64
    assert first["bytes"]["pp_forward"] == 2 * 16 * 32 * 8
    assert last["bytes"]["pp_backward"] == 2 * (16 + 32) * 2 * 8  # P [16, 2] and Q [32, 2] per micro-batch
    assert set(last["saved"]) == {"q.0", "error.0"} and last["saved"]["error.0"].abs().sum() > 0
    assert all(torch.equal(last["saved"][k], last["restored"][k]) for k in last["saved"])


# ------------------------------------------------------------------------ kernels, interpreted


def test_triton_kernels_match_references_under_the_interpreter():
    script = r"""
import json, os
import torch
from commfx.kernels import powersgd as k
out = {}
torch.manual_seed(0)
for dtype in (torch.float32, torch.float64):
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    p = torch.randn(37, 5, dtype=dtype)
    p[:, 3] = p[:, 0] + 2 * p[:, 1]  # rank deficient: that column must come out zero
    a = k._orthogonalize_triton(p, block_n=16)
    out[f"orth {dtype}"] = (a - k.orthogonalize_reference(p)).abs().max().item() <= tol and a[:, 3].abs().max().item() <= tol
    m, q = torch.randn(37, 19, dtype=dtype), torch.randn(19, 5, dtype=dtype)
    out[f"residual {dtype}"] = (k._lowrank_residual_triton(m, p, q, 16, 8) - k.lowrank_residual_reference(m, p, q)).abs().max().item() <= tol * 10
print(json.dumps(out))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results and all(results.values()), results


def test_references_orthonormalise_and_subtract():
    p = torch.randn(20, 4, dtype=torch.float64)
    o = orthogonalize_reference(p)
    assert (o.T @ o - torch.eye(4, dtype=torch.float64)).abs().max().item() <= 1e-12
    m, q = torch.randn(20, 7, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    assert torch.allclose(lowrank_residual_reference(m, o, q), m - o @ q.T)


# ------------------------------------------------------------ selective stage compression


def test_selective_stage_compression_plan_and_dump():
    model, inputs = load_model("gpt-moe")
    with pytest.raises(PlanError, match=r"dp_stages=3: .* from 0 to pp=2"):
        check_plan(Plan.from_cli("lift,pipeline_split,compress_pipeline:dp_stages=3", world_size=4, pp=2), model)
    with pytest.raises(PlanError, match=r"dp_stages=1 compresses the data-parallel all-reduce, but this plan has dp=1"):
        check_plan(Plan.from_cli("lift,pipeline_split,compress_pipeline:dp_stages=1", world_size=2, pp=2), model)
    with pytest.raises(PlanError, match="dp_rank must be at least 1, got 0"):
        check_plan(Plan.from_cli("lift,pipeline_split,compress_pipeline:dp_stages=1;dp_rank=0", world_size=4, pp=2), model)
    plan = Plan.from_cli("lift,pipeline_split,compress_pipeline:boundaries=none;dp_stages=1;dp_rank=2", world_size=4, pp=2)
    pipeline = compile_program(model, plan, inputs).regions.pipeline
    assert [b.codec for b in pipeline.boundaries] == [None]
    assert [str(s.dp_codec) if s.dp_codec else None for s in pipeline.stages] == [
        "PowerSGD rank 2 data-parallel all-reduce, error feedback", None
    ]
    assert "data-parallel gradients: PowerSGD rank 2" in pipeline.describe()


@pytest.mark.distributed
def test_data_parallel_powersgd_is_exact_at_low_rank_and_one_residual_behind():
    sys.path.insert(0, str(TESTS))
    results = launch("pipeline_workers:dp_powersgd", 2, timeout_s=120)
    for r in results:
        assert r["low_rank_diff"] <= 1e-10, r["low_rank_diff"]
        assert r["shapes"] == {"w": (24, 10), "experts": (2, 24, 10)}
        assert r["telescoping"] <= 1e-10, r["telescoping"]  # sum(reduced) = sum(exact) - mean_i E_i
        assert r["drift True"] * 5 < r["drift False"], (r["drift True"], r["drift False"])
    for key in ("q True", "q False"):  # Q is the reduced one: the same on every rank
        assert torch.equal(results[0][key], results[1][key])


@pytest.mark.distributed
def test_selective_stage_compression_on_pp2_dp2():
    """Stage 0's matrices go as rank-2 PowerSGD factors over dp; stage 1 and every vector
    reduce exactly. What stage 0 applies plus the mean residual is the exact gradient."""
    sys.path.insert(0, str(TESTS))
    passes = "lift,pipeline_split,compress_pipeline:boundaries=none;dp_stages=1;dp_rank=2"
    results = launch("pipeline_workers:selective_dp_compression", 4, {"passes": passes}, timeout_s=400)
    for r in results:
        exact, got = r["exact"]["grads"], r["compressed"]["grads"]
        assert set(exact) == set(got)
        compressed = set(r["compressed_names"])
        if r["stage"] == 1:
            assert not compressed and not r["saved"]
            assert r["compressed"]["bytes"] == r["exact"]["bytes"]
        else:
            assert compressed and all(got[n].dim() >= 2 for n in compressed)
            lossy = 0.0
            for name in compressed:
                assert (got[name] + r["mean_errors"][name] - exact[name]).abs().max().item() <= 1e-10, name
                matrices = got[name].reshape(-1, *got[name].shape[-2:])
                assert int(torch.linalg.matrix_rank(matrices).max()) <= 2, name
                lossy = max(lossy, (got[name] - exact[name]).abs().max().item())
            assert lossy > 1e-6, "rank 2 should lose something on these gradients"
            # ring all-reduce over 2 ranks sends the payload once: P [rows, 2] then Q [cols, 2] per
            # matrix (an expert stack [experts, rows, cols] is one matrix per expert), float64
            factors = sum(2 * (got[n].shape[-2] + got[n].shape[-1]) * 8 * got[n][..., 0, 0].numel() for n in compressed)
            assert r["compressed"]["bytes"]["grad_powersgd"] == factors
            dense = sum(exact[n].numel() * 8 for n in compressed)
            assert r["compressed"]["bytes"]["grad_all_reduce"] == r["exact"]["bytes"]["grad_all_reduce"] - dense
            assert set(r["saved"]) == {f"{k}.{n}" for n in compressed for k in ("q", "error")}
            assert all(torch.equal(r["saved"][k], r["restored"][k]) for k in r["saved"])
        for name in set(exact) - compressed:
            assert (got[name] - exact[name]).abs().max().item() <= 1e-12, (r["stage"], name)
