"""peer:dtensor_tp (bench/peers/dtensor_tp.py, issue 29): the attention and MLP blocks split by
torch's own DTensor ColwiseParallel/RowwiseParallel with the plan commfx's tensor_parallel
infers, the whole batch on every rank. On 2 gloo ranks in float64 it equals the single-process
model (outputs, loss, every gradient, the AdamW step); a wrong split, a rank holding other
weights, a fused q/k/v and attention code that shapes heads from the full width are caught or
refused by name; the bench times it beside commfx's plan with `--tp 2`."""

import json
from pathlib import Path

import pytest

from commfx.cli.main import main
from commfx.runtime.launcher import launch

TESTS = str(Path(__file__).parent)
EXACT = 1e-12  # float64: only the order of the rowwise partial sums differs


def _checks(cases: list[dict]) -> list[list[dict]]:
    """Per case, both ranks' results."""
    per_rank = launch("peer_workers:dtensor_tp_checks", 2, {"cases": cases}, timeout_s=300)
    return [list(case) for case in zip(*per_rank)]


@pytest.mark.distributed
def test_dtensor_tp_equals_the_single_process_model_and_catches_what_differs():
    cases = [{"model": "dense-heads"}, {"model": "hf:llama"}, {"model": "hf:qwen3"},
             # rank 1's copy of a split weight differs: DTensor scatters rank 0's, rank 1's reference is its own
             {"model": "dense-heads", "perturb": "layers.0.attn.q_proj.weight"},
             # a wrong split: q_proj rowwise instead of colwise
             {"model": "dense-heads", "restyle": {"layers.1.attn.q_proj": "rowwise"}},
             # fused q/k/v (gpt-moe's attention): ColwiseParallel cannot split it by heads
             {"model": "gpt-moe-tiny"},
             # heads shaped from the replicated input's width (d // num_heads): wrong on local shards
             {"model": "dense-full-width"}]
    heads, llama, qwen3, perturbed, wrong_split, fused, full_width = _checks(cases)
    for results in (heads, llama, qwen3):
        for r in results:
            assert r["ok"], r["line"]
            assert len(r["grad_diffs"]) >= 20 and len(r["step_diffs"]) == len(r["grad_diffs"])
            assert r["output_diff"] <= EXACT and r["loss_diff"] <= EXACT, r["line"]
            assert max(r["grad_diffs"].values()) <= EXACT and max(r["step_diffs"].values()) <= EXACT, r["line"]
            assert max(r["model_step_diffs"].values()) <= 1e-10, r["line"]
            assert r["line"].startswith("dtensor_tp: equal to the single-process model")
    # the plan is commfx's: attention by heads, MLP by columns, in every layer
    plan = heads[0]["notes"][0]
    assert "layers.1.attn: q_proj,k_proj,v_proj colwise; o_proj rowwise (4 heads)" in plan and "layers.1.mlp: 0 colwise; 2 rowwise" in plan
    assert "layers.0.attn.num_heads 4 -> 2" in heads[0]["notes"]  # torchtitan's first plans: n_heads // tp
    assert any("SequenceParallel" in n and "model.layers.1.self_attn.k_norm" in n for n in qwen3[0]["notes"])
    for r in perturbed:
        assert not r["ok"] and "NOT equal" in r["line"], r["line"]
    for r in wrong_split:
        assert "does not run on its local shards" in r["unsupported"] and "layers.1.attn.q_proj rowwise" in r["unsupported"]
    for r in fused:
        assert r["unsupported"].startswith("layers.0.attn.qkv: a fused linear of 3 parts"), r
    for r in full_width:
        assert "does not run on its local shards" in r["unsupported"] and "is invalid for input of size" in r["unsupported"]


@pytest.mark.distributed
def test_dtensor_tp_steps_records_and_compute_only():
    results = launch("peer_workers:dtensor_tp_steps", 2, {"model": "hf:llama"}, timeout_s=300)
    from commfx.models import load_model

    model, (ids,) = load_model("hf:llama", batch=4)
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    # per layer: o_proj's and down_proj's outputs in forward, q/k/v's and gate/up's input gradients in backward
    one = ids.numel() * hidden * 4
    for r in results:
        assert [tuple(record) for record in r["records"]] == [("all_reduce", 2, one)] * (7 * layers)
        assert r["bytes"] == {"all_reduce": 7 * layers * one}
        assert r["compute_only_collectives"] == 0 and r["records_after_compute_only"] == 7 * layers
        assert r["losses"][1] < r["losses"][0]
    assert results[0]["losses"] == results[1]["losses"]  # the whole batch on both ranks, one replicated loss


@pytest.mark.distributed
def test_dtensor_tp_refuses_a_split_batch():
    for message in launch("peer_workers:dtensor_tp_split_batch", 2, {}, timeout_s=120):
        assert "ranks were handed different batches: run the bench with --tp 2" in message


def test_preflight_refuses_a_head_count_the_world_does_not_divide():
    import sys

    sys.path.insert(0, TESTS)
    from peer_workers import DenseHeads

    from commfx.bench.peers import PeerUnsupported, peer_module

    module = peer_module("dtensor_tp")
    module.preflight(DenseHeads(heads=4), ep_size=1, world_size=2)
    with pytest.raises(PeerUnsupported, match=r"layers.0.attn.num_heads=4: tensor parallelism over the 3 ranks"):
        module.preflight(DenseHeads(heads=4), ep_size=1, world_size=3)
    from commfx.models import load_model

    model, inputs = load_model("gpt-moe-tiny")  # given the batch, the plan is inferred here: a fused qkv is refused
    module.preflight(model, ep_size=1, world_size=2)
    with pytest.raises(PeerUnsupported, match=r"layers.0.attn.qkv: a fused linear of 3 parts"):
        module.preflight(model, ep_size=1, world_size=2, inputs=inputs)


@pytest.mark.slow  # a bench run with a peer beside a commfx plan: test_peers_sharded_and_staged runs one by default
@pytest.mark.distributed
def test_bench_times_dtensor_tp_beside_commfx_tensor_parallel(tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "hf:llama", "--passes", "lift,tensor_parallel", "--tp", "2", "--vs", "peer:dtensor_tp", "--nodes", "1",
            "--ranks-per-node", "2", "--no-emulation", "--steps", "1", "--warmup", "0", "--batch", "4", "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().out
    plans = {p["label"]: p for p in json.loads(out.read_text())["plans"]}
    peer = plans["baseline"]
    assert peer["peer_check"].startswith("dtensor_tp: equal to the single-process model")
    # --tp 2 hands both ranks the whole batch: 14 all-reduces of [4, 8, hidden] float32 on each of 2 ranks
    from commfx.models import load_model

    model, (ids,) = load_model("hf:llama", batch=4)
    assert peer["peer_payload_bytes_per_step"] == {"all_reduce": 2 * 14 * ids.numel() * model.config.hidden_size * 4}
    assert peer["compute_only"]["median_s"] > 0 and len(peer["wall"]["samples_s"]) == 1
