"""shard_states (ZeRO stages 1, 2 and 3): lossless against the replicated plan (losses and
parameters after 3 AdamW steps under an LR scheduler, and one more step after the sharded
state_dict is reloaded, float64, world 2), dense data parallel and with expert_parallel
(experts whole with ep == world, sharded over edp with ep=1), under partition_a2a's
priority lanes; each rank steps and holds less; stage 2 without its sharded optimizer; the
plan errors; what `commfx dump` prints; `commfx verify` at stages 2 and 3, from the gradient
shards, and failing on a wrong one."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from commfx.compiler.pass_manager import check_plan
from commfx.models import load_model
from commfx.plan import Plan, PlanError
from commfx.runtime.launcher import launch
from shard_workers import STEPS

EP = "lift,expert_parallel"
LINA = "lift,expert_parallel,partition_a2a:k=2;grad_chunk_bytes=1024"
# (replicated plan, sharded plan); "|ep=1": experts replicated over both ranks (edp)
PAIRS = [
    ("lift", "lift,shard_states:stage=1"),
    ("lift", "lift,shard_states:stage=2"),
    (EP, f"{EP},shard_states:stage=1"),
    (EP, f"{EP},shard_states:stage=2"),
    (f"{EP}|ep=1", f"{EP},shard_states:stage=2|ep=1"),
    (EP, f"{LINA},shard_states:stage=2;bucket_bytes=2048"),
    ("lift", "lift,shard_states:stage=3"),
    (f"{EP}|ep=1", f"{EP},shard_states:stage=3|ep=1"),
    (EP, f"{LINA},shard_states:stage=3;bucket_bytes=2048"),
]


@pytest.mark.distributed
def test_sharded_steps_equal_replicated_steps_and_hold_less():
    plans = list(dict.fromkeys(p for pair in PAIRS for p in pair))
    # 4 KiB buckets: several per group, and parameters cut across the ranks' shards
    results = launch("shard_workers:train_each_plan", 2, {"plans": plans, "bucket_bytes": 4096, "with_misuse": True}, timeout_s=300, collective_timeout_s=60)
    for rank, result in enumerate(results):
        for plain, sharded in PAIRS:
            want, got = result[plain], result[sharded]
            torch.testing.assert_close(got["losses"], want["losses"], rtol=0, atol=1e-12)
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-12, msg=f"rank {rank} {sharded} {name}")
                torch.testing.assert_close(got["resumed"][name], want["resumed"][name], rtol=0, atol=1e-12, msg=f"reloaded {sharded} {name}")
            assert got["stepped"] < want["stepped"], (sharded, got["stepped"], want["stepped"])
            assert got["memory"]["optimizer_state"] < want["memory"]["optimizer_state"]
            if ":stage=3" in sharded:  # parameters sharded too (all but whole experts, with ep == world)
                assert got["memory"]["parameters"] < want["memory"]["parameters"], (sharded, got["memory"], want["memory"])
                # the first step records each bucket's readers (all gathered up front, all freed);
                # later forwards keep only the bucket the backward reads first, backwards free all;
                # settle() leaves them sharded, synchronize() gathers every one
                whole = got["whole_after_forward_and_backward"]
                assert got["buckets"] > 1 and whole[2:] == [1, 0] * (STEPS - 1) + [0, got["buckets"]], (sharded, got)
            else:
                assert got["memory"]["parameters"] == want["memory"]["parameters"]
        dense, stage1, stage2 = (result[p]["memory"] for p in ("lift", "lift,shard_states:stage=1", "lift,shard_states:stage=2"))
        assert stage1["gradients"] == dense["gradients"]
        assert stage2["gradients"] == dense["gradients"] // 2  # every parameter replicated over 2 ranks: half each
        stage3 = result["lift,shard_states:stage=3"]["memory"]
        assert stage3["parameters"] <= dense["parameters"] // 2 + 8 * 64 and stage3["gradients"] == stage2["gradients"]  # + padding
        # Adam's two moments: half of each, plus a step counter per parameter part
        assert stage1["optimizer_state"] < dense["optimizer_state"] // 2 + 8 * 2 * len(result["lift"]["params"])
        # stage 2 with a plain optimizer, and a backward before its sharded optimizer exists
        said = result["misuse"]
        assert "commfx.shard_optimizer(dm, torch.optim.AdamW" in said["attach"]
        assert "make that optimizer before the first backward" in said["backward"]


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_states_with_tensor_parallelism_equal_the_replicated_plan():
    """tp 2 x dp 2: tensor_parallel's shards and the replicated parameters bucketed over dp."""
    plain, sharded = "lift,tensor_parallel|tp=2", "lift,tensor_parallel,shard_states:stage=3|tp=2"
    results = launch("shard_workers:train_each_plan", 4, {"plans": [plain, sharded], "bucket_bytes": 4096}, timeout_s=300, collective_timeout_s=60)
    for rank, result in enumerate(results):
        want, got = result[plain], result[sharded]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=0, atol=1e-12)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-12, msg=f"rank {rank} {name}")
            torch.testing.assert_close(got["resumed"][name], want["resumed"][name], rtol=0, atol=1e-12, msg=f"reloaded {name}")
        assert got["memory"]["parameters"] * 2 <= want["memory"]["parameters"] + 64, (got["memory"], want["memory"])
        assert got["memory"]["optimizer_state"] < want["memory"]["optimizer_state"]


PIPELINE = "lift,expert_parallel,pipeline_split"


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_states_inside_pipeline_stages_equal_replicated_stages():
    """pp=2 x dp=2: each stage's optimizer state (stage 1), reduced gradients (stage 2) and
    parameters between steps (stage 3) sharded over its own dp group."""
    plans = [PIPELINE, *(f"{PIPELINE},shard_states:stage={s}" for s in (1, 2, 3))]
    results = launch("shard_workers:train_pipeline_plans", 4, {"plans": plans}, timeout_s=400, collective_timeout_s=90)
    for rank, result in enumerate(results):
        want = result[PIPELINE]
        for sharded in plans[1:]:
            got = result[sharded]
            if want["losses"][0] is not None:  # the last stage holds the loss
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-12)
            assert want["params"] and got["params"].keys() == want["params"].keys()
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-12, msg=f"rank {rank} {sharded} {name}")
                torch.testing.assert_close(got["resumed"][name], want["resumed"][name], rtol=0, atol=1e-12, msg=f"reloaded {sharded} {name}")
            assert got["memory"]["optimizer_state"] < want["memory"]["optimizer_state"], (rank, sharded)
        assert result[plans[2]]["memory"]["gradients"] < want["memory"]["gradients"], rank
        assert result[plans[3]]["memory"]["parameters"] < want["memory"]["parameters"], rank  # held after the step: shards
    assert {r[PIPELINE]["stage"] for r in results} == {0, 1}


@pytest.mark.parametrize(
    "passes, topology, message",
    [
        ("lift,shard_states:stage=0", {}, "stage must be 1, 2 or 3"),
        ("lift,tensor_parallel,pipeline_split,shard_states", {"tp": 2, "pp": 2, "world_size": 4}, "both pipeline stages and tensor parallelism"),
        ("lift,expert_parallel,shard_states,defer_grad_sync", {}, "shard_states does not work with defer_grad_sync"),
        ("lift,expert_parallel,pack_experts,shard_states:stage=2", {}, "does not work with pack_experts"),
    ],
)
def test_shard_states_plan_errors(passes, topology, message):
    model, _ = load_model("gpt-moe")
    with pytest.raises(PlanError, match=message):
        check_plan(Plan.from_cli(passes, **{"world_size": 2, **topology}), model)


def test_shard_states_under_torch_compile_is_a_plan_error():
    from commfx.backend import backend

    with pytest.raises(PlanError, match="shard_states needs commfx.distribute"):
        backend(Plan.from_cli("lift,shard_states", world_size=1))


def test_dump_shows_the_buckets_and_what_each_rank_holds():
    from commfx.compiler.pipeline import compile_program

    model, inputs = load_model("gpt-moe-tiny")
    program = compile_program(model, Plan.from_cli("lift,expert_parallel,shard_states:stage=2;bucket_bytes=8192", world_size=2), inputs)
    notes = [n for n in program.notes if n.startswith("shard_states")]
    assert "buckets of <= 8,192 bytes reduce-scattered into each rank's shard" in notes[0]
    buckets = [n for n in notes if ": bucket " in n]
    assert any(" over dp (2 ranks)" in n and "per rank (1/2)" in n for n in buckets)
    assert any(" over edp (1 rank)" in n and "whole (a group of one)" in n for n in buckets)
    named = " ".join(buckets)
    assert "lm_head.weight" in named and "experts.down_proj" in named


def test_bucket_bytes_auto_follows_the_machine():
    from commfx.compiler.pipeline import compile_program

    model, inputs = load_model("gpt-moe-tiny")

    def chosen(**figures) -> int:
        plan = Plan.from_cli("lift,shard_states:stage=3;bucket_bytes=auto", world_size=2, ranks_per_node=1, **figures)
        program = compile_program(model, plan, inputs)
        line = next(n for n in program.notes if "bucket_bytes=auto" in n)
        size = program.runtime.shard_states["bucket_bytes"]
        assert f"{size:,} bytes" in line and any(f"buckets of <= {size:,} bytes" in n for n in program.notes)
        return size

    fast = chosen(inter_node_bandwidth=50e9, collective_overhead_s=20e-6)  # a GPU cluster's link
    slow = chosen(inter_node_bandwidth=125e6, collective_overhead_s=0.5e-3, inter_node_latency_s=0.0)  # 1 Gbit/s, gloo's per-call cost
    assert fast > 10 * slow and slow >= 64 * 1024, (fast, slow)  # per-call cost x bandwidth: 16x apart
    # an all-gather of a 2-rank bucket sends half of it: 0.5 ms <= a tenth of the call when
    # half the bucket takes 9 x 0.5 ms at 125 MB/s, a bucket of 1,125,000 bytes (to the KiB above)
    assert slow == 1_125_376
    with pytest.raises(PlanError, match="bucket_bytes must be bytes >= 0 .* or auto"):
        check_plan(Plan.from_cli("lift,shard_states:bucket_bytes=big", world_size=2), model)


@pytest.mark.distributed
def test_verify_checks_stages_2_and_3_from_the_gradient_shards():
    """verify under ZeRO-2/3: each rank's shards of the reduced gradients, gathered whole over
    their bucket's group, equal the single-process float64 reference, every parameter's (2 KiB
    buckets cut parameters across the ranks' shards; default ones, one dp bucket cut in two)."""
    from commfx.verify import VerifyCase, verify

    plans = [f"{EP},shard_states:stage=2;bucket_bytes=2048", f"{EP},shard_states:stage=3"]
    reports = verify([VerifyCase("gpt-moe-tiny", Plan.from_cli(p, world_size=2)) for p in plans], 2, timeout_s=300)
    model, _ = load_model("gpt-moe-tiny")
    for passes, report in zip(plans, reports):
        assert report.ok and report.max_diff <= 1e-10, (passes, report.failures)
        assert set(report.grad_diffs) == {name for name, _ in model.named_parameters()}, passes


@pytest.mark.distributed
def test_verify_fails_a_wrong_gradient_shard():
    """One element of rank 1's reduced-gradient shard off by 1e-6 after backward (stage 3):
    the parameter it belongs to fails by that much, and only it."""
    from commfx.verify import VerifyCase, checked_reference, compare

    case = VerifyCase("gpt-moe-tiny", Plan.from_cli(f"{EP},shard_states:stage=3;bucket_bytes=2048", world_size=2))
    results = launch("shard_verify_workers:verify_with_a_wrong_shard", 2, {"cases": [case]}, timeout_s=300, collective_timeout_s=60)
    report = compare(case, [r[0] for r in results], 2, 1e-10, checked_reference(case, 2))
    wrong = results[1][0]["wrong"]
    assert wrong is not None and results[0][0]["wrong"] is None
    assert report.failures == [wrong], report.failures
    assert report.grad_diffs[wrong] == pytest.approx(1e-6, rel=1e-6)
