"""Peers in `commfx bench` (bench/peers/, issue 29): `peer:ddp` equals the single-process model
(float64, 2 gloo ranks), and a bench run with peers beside a commfx plan checks each peer
first, times it in the same interleaved rounds and reports its own byte count."""

import json
from pathlib import Path

import pytest

from commfx.bench.peers.deepspeed_moe import deepspeed_version
from commfx.cli.main import main
from commfx.runtime.launcher import launch

pytestmark = pytest.mark.distributed
TESTS = str(Path(__file__).parent)


def test_ddp_equals_the_single_process_model_and_a_rank_with_other_weights_fails():
    equal = launch("peer_workers:ddp_check", 2, {"model": "gpt-moe-tiny"}, timeout_s=120)
    for result in equal:
        assert result["ok"], result["line"]
        assert len(result["grad_diffs"]) >= 10 and max(result["grad_diffs"].values()) <= 1e-12, result["line"]
    differs = launch("peer_workers:ddp_check", 2, {"model": "gpt-moe-tiny", "perturb_rank": 0}, timeout_s=120)
    assert all(not r["ok"] and "NOT equal" in r["line"] for r in differs), [r["line"] for r in differs]


def test_a_model_that_returns_its_loss_is_compared_by_its_loss():
    for result in launch("peer_workers:ddp_check_on_a_loss_model", 2, {}, timeout_s=120):
        assert result["ok"] and result["loss_diff"] <= 1e-12, result["line"]


def test_bench_times_peers_beside_a_plan(tmp_path, capsys):
    also = ["--also", "ds=peer:deepspeed_moe"] if deepspeed_version() else []
    out = tmp_path / "peers.json"
    argv = ["bench", "gpt-moe-tiny", "--passes", "lift,expert_parallel", "--vs", "peer:ddp", *also, "--nodes", "1",
            "--ranks-per-node", "2", "--no-emulation", "--steps", "2", "--warmup", "0", "--batch", "4", "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().out
    plans = {p["label"]: p for p in json.loads(out.read_text())["plans"]}
    ddp = plans["baseline"]
    assert ddp["peer_check"].startswith("ddp: equal to the single-process model")
    # DDP all-reduces every gradient once a step: the model's float32 parameter bytes, on each of 2 ranks.
    from commfx.models import load_model

    model, _ = load_model("gpt-moe-tiny", batch=4)
    assert ddp["peer_payload_bytes_per_step"] == {"all_reduce": 2 * sum(p.numel() * 4 for p in model.parameters())}
    assert ddp["bytes_per_step"] == {} and plans["plan"]["peer_check"] is None
    assert all(len(p["wall"]["samples_s"]) == 2 and p["comm_only"]["median_s"] > 0 for p in plans.values())
    if also:
        assert plans["ds"]["peer_check"].startswith("deepspeed_moe: equal to the single-process model")
        assert plans["ds"]["peer_payload_bytes_per_step"]["all_to_all"] > 0


@pytest.mark.parametrize(
    "vs, message",
    [("peer:horovod", "unknown peer 'horovod': the peers are compile, ddp, deepspeed_moe"),
     ("peer:ddp --slow-rank 1:2 --slow-method delay", "only with --slow-method cgroup")],
)
def test_peer_errors_are_clear_and_come_before_any_rank(vs, message, capsys):
    argv = ["bench", "gpt-moe-tiny", "--passes", "lift,expert_parallel", "--nodes", "1", "--ranks-per-node", "2",
            "--no-emulation", "--vs", *vs.split()]
    assert main(argv) == 2
    assert message in capsys.readouterr().out
