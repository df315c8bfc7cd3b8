"""Peer `deepspeed_moe`: the model's MoE blocks as DeepSpeed-MoE layers equal the single-process
model (2 gloo ranks, float64 but for DeepSpeed's float32 gate, at the peer's named tolerance),
train and run a compute-only step, and what DeepSpeed cannot express is refused by name.

Skipped when DeepSpeed is not installed (`pip install 'commfx[peers]'`).
"""

from pathlib import Path

import pytest
import torch

from commfx.bench.peers import PeerUnsupported, peer_module
from commfx.bench.peers.deepspeed_moe import PEER_TOLERANCE, deepspeed_version, find_moe_blocks, preflight
from commfx.models import load_model
from commfx.runtime.launcher import launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(deepspeed_version() is None, reason="DeepSpeed is not installed (pip install 'commfx[peers]')"),
]
TESTS = str(Path(__file__).parent)

EQUAL_CASES = [
    # (what, case): every case is checked on the same 2-rank world, in float64.
    ("gpt-moe top-2, ep 2", {"model": "gpt-moe", "model_kwargs": {"batch": 4}, "ep_size": 2}),
    ("gpt-moe top-3 (topkgating), ep 2", {"model": "gpt-moe", "model_kwargs": {"batch": 4, "top_k": 3}, "ep_size": 2}),
    ("gpt-moe, ep 1 (experts replicated, edp all-reduce)", {"model": "gpt-moe", "model_kwargs": {"batch": 4}, "ep_size": 1}),
    ("gpt-moe, capacity that drops nothing",
     {"model": "gpt-moe", "model_kwargs": {"batch": 4}, "ep_size": 2, "drop_tokens": True, "capacity_factor": 4.0}),
    ("hf:mixtral", {"model": "hf:mixtral", "ep_size": 2}),
    ("hf:qwen3_moe", {"model": "hf:qwen3_moe", "ep_size": 2}),
]
NOT_EQUAL_CASES = [
    # DeepSpeed's capacity drops otherwise than the model (which drops nothing): the check must say so.
    ("gpt-moe, capacity 1.0 drops", {"model": "gpt-moe", "model_kwargs": {"batch": 4}, "ep_size": 2, "drop_tokens": True,
                                     "capacity_factor": 1.0}),
    # A wrong expert activation (GELU for SiLU) on rank 1's experts only.
    ("gpt-moe, wrong expert on rank 1", {"model": "gpt-moe", "model_kwargs": {"batch": 4}, "ep_size": 2, "break_rank": 1}),
]
REFUSED_CASES = [
    ("experts do not divide over ep", {"model": "gpt-moe", "model_kwargs": {"batch": 4, "num_experts": 3}, "ep_size": 2},
     "3 experts do not divide over ep_size=2"),
    ("ep does not divide the world", {"model": "gpt-moe", "model_kwargs": {"batch": 4}, "ep_size": 4},
     "ep_size=4 must divide the world size 2"),
]


@pytest.fixture(scope="module")
def checks():
    cases = [case for _, case in EQUAL_CASES + NOT_EQUAL_CASES] + [case for _, case, _ in REFUSED_CASES]
    return launch("peer_workers:deepspeed_moe_check", 2, {"cases": cases}, timeout_s=240)


def test_equal_to_the_single_process_model(checks):
    for rank_results in checks:
        for (what, _), result in zip(EQUAL_CASES, rank_results):
            assert "unsupported" not in result, (what, result)
            assert result["ok"], (what, result["line"])
            assert result["tolerance"] == PEER_TOLERANCE
            assert len(result["grad_diffs"]) >= 10, what  # every parameter was compared
            # The float32 gate is the only inexact part: far inside the tolerance, and not exact.
            assert 0 < max(result["grad_diffs"].values()) < PEER_TOLERANCE / 8, (what, result["line"])
            assert max(result["step_diffs"].values()) <= 1e-10, (what, result["line"])


def test_the_check_fails_when_the_peer_computes_another_function(checks):
    offset = len(EQUAL_CASES)
    for rank_results in checks:
        dropped, broken = rank_results[offset:offset + len(NOT_EQUAL_CASES)]
        assert not dropped["ok"] and dropped["output_diff"] > 1e-3, dropped["line"]
        assert any("dropped for capacity on the most-dropping rank" in n and "not the same function" in n for n in dropped["notes"])
        # Rank 1's wrong experts show on both ranks: their rows come back through the all-to-all.
        assert not broken["ok"] and broken["output_diff"] > 1e-3, broken["line"]
        assert "NOT equal" in broken["line"]


def test_refusals_on_ranks(checks):
    offset = len(EQUAL_CASES) + len(NOT_EQUAL_CASES)
    for rank_results in checks:
        for (what, _, message), result in zip(REFUSED_CASES, rank_results[offset:]):
            assert message in result.get("unsupported", ""), (what, result)


def test_trains_and_runs_compute_only():
    (rank0, rank1) = launch("peer_workers:deepspeed_moe_steps", 2, {"steps": 3}, timeout_s=120)
    for result in (rank0, rank1):
        losses = result["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
        # Per step: 2 layers x (dispatch + combine) forward and again backward; all-reduces: each
        # layer's capacity, then the engine's gradient buckets.
        assert result["kinds"]["all_to_all"] == 8 and result["kinds"]["all_reduce"] >= 3, result["kinds"]
        assert result["bytes"]["all_to_all"] > 0
        assert result["compute_only_kinds"] == result["kinds"], "compute-only issues the same collectives, locally"
        assert result["step_ran_collectives"] >= 11 and result["compute_only_ran_collectives"] == 0, result
    assert rank0["params_digest"] == rank1["params_digest"], "non-expert parameters stay replicated"


def test_refuses_what_deepspeed_cannot_express():
    model, _ = load_model("gpt-moe", top_k=1)
    with pytest.raises(PeerUnsupported, match="top-1 gate weights the expert by its softmax probability"):
        find_moe_blocks(model)

    model, _ = load_model("gpt-moe")
    model.layers[1].moe.router.logit_bias[3] = -1e4
    with pytest.raises(PeerUnsupported, match=r"layers.1.moe.router has a nonzero logit_bias"):
        find_moe_blocks(model)

    model, _ = load_model("hf:qwen3_moe")
    model.model.layers[0].mlp.gate.norm_topk_prob = False
    with pytest.raises(PeerUnsupported, match=r"model.layers.0.mlp \(qwen3_moe, top_k=2\): DeepSpeed's top-2 gate renormalises"):
        find_moe_blocks(model)

    model, _ = load_model("hf:mixtral")
    model.model.layers[1].mlp.jitter_noise = 0.1
    with pytest.raises(PeerUnsupported, match="random jitter"):
        find_moe_blocks(model)

    model, _ = load_model("hf:mixtral")
    model.config.output_router_logits = True
    with pytest.raises(PeerUnsupported, match="output_router_logits=True"):
        find_moe_blocks(model)

    model, _ = load_model("hf:olmoe")
    with pytest.raises(PeerUnsupported, match=r"model.layers.0.mlp.experts.gate_up_proj \(OlmoeExperts\) holds stacked expert "
                                              "weights in a block the deepspeed_moe peer does not know"):
        find_moe_blocks(model)

    model, _ = load_model("gpt-moe", num_experts=6)
    with pytest.raises(PeerUnsupported, match="ep_size=4 must divide the world size 6"):
        preflight(model, ep_size=4, world_size=6)
    with pytest.raises(PeerUnsupported, match="layers.0.moe: 6 experts do not divide over ep_size=4"):
        preflight(model, ep_size=4, world_size=8)
    assert [s.path for s in preflight(model, ep_size=3, world_size=6)] == ["layers.0.moe", "layers.1.moe"]

    assert issubclass(PeerUnsupported, ValueError)
    assert peer_module("deepspeed_moe").DeepSpeedMoEPeer.name == "deepspeed_moe"
    with pytest.raises(ValueError, match="unknown peer 'ddpp': the peers are compile, ddp, deepspeed_moe"):
        peer_module("ddpp")


def test_finds_every_block_with_its_routing():
    model, _ = load_model("gpt-moe", top_k=3)
    specs = find_moe_blocks(model)
    assert [(s.path, s.kind, s.top_k, s.num_experts, s.renormalize) for s in specs] == [
        ("layers.0.moe", "gpt-moe", 3, 8, True), ("layers.1.moe", "gpt-moe", 3, 8, True)]
    assert specs[0].router_weight == "layers.0.moe.router.weight"
    model, _ = load_model("hf:mixtral")
    assert [s.path for s in find_moe_blocks(model)] == ["model.layers.0.mlp", "model.layers.1.mlp"]
