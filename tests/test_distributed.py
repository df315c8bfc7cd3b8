"""Multi-process gloo tests: expert parallel equals the single-process float64 reference.

Each test launches one local world (spawned processes, free ports, bounded time) and runs
several cases in it, to keep the suite fast on 2 cores.
"""

import sys
from pathlib import Path

import pytest

import torch

from commfx.models import load_model
from commfx.plan import Plan, Topology, PassSpec
from commfx.runtime.launcher import LaunchError, launch
from commfx.verify import VerifyCase, verify

pytestmark = pytest.mark.distributed
TESTS = str(Path(__file__).parent)


def cases(world_size):
    dropless = Plan.from_cli("lift,expert_parallel", world_size=world_size)
    capacity = Plan.from_cli("lift,expert_parallel:capacity_factor=1.0", world_size=world_size)
    return [
        # batch 2W+1 does not divide: uneven tokens per rank; expert 3 receives no tokens.
        VerifyCase("gpt-moe", dropless, batch=2 * world_size + 1, starve_expert=3),
        VerifyCase("gpt-moe", capacity, batch=2 * world_size + 1, starve_expert=3),
        VerifyCase("hf:mixtral", dropless, batch=world_size + 1),
        VerifyCase("hf:mixtral", capacity, batch=world_size),
    ]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_expert_parallel_equals_reference(world_size):
    reports = verify(cases(world_size), world_size, timeout_s=600)
    for report in reports:
        assert report.ok, (report.case.model, report.max_diff, report.grad_diffs)
        assert report.grad_diffs, "no gradients were compared"
    tokens = reports[0].tokens_per_rank
    assert len(set(tokens)) > 1, f"tokens per rank should be uneven, got {tokens}"


def test_ep_smaller_than_world_replicates_experts_over_edp():
    plan = Plan(Topology(world_size=4, ep=2), (PassSpec("lift"), PassSpec("expert_parallel")))
    (report,) = verify([VerifyCase("gpt-moe", plan, batch=7)], 4, timeout_s=300)
    assert report.ok, (report.max_diff, report.grad_diffs)


def test_a_rank_that_dies_stops_the_others_with_an_error():
    sys.path.insert(0, TESTS)
    with pytest.raises(LaunchError, match=r"rank 1 failed \(exit code 17\)"):
        launch("dist_workers:die_mid_step", 2, {"dying_rank": 1}, timeout_s=120, collective_timeout_s=20, grace_s=10)


def test_world_size_mismatch_is_a_clear_error():
    with pytest.raises(LaunchError, match=r"the plan is for world size 3 but the process group has 2 ranks"):
        launch("dist_workers:wrong_world_size", 2, {}, timeout_s=120)


def test_replicas_built_from_different_seeds_are_named_or_broadcast():
    """Ranks that build the model from different seeds would train diverging replicas."""
    sys.path.insert(0, TESTS)
    checked = launch("dist_workers:diverging_replicas", 2, {"replicas": "check"}, timeout_s=180)
    for result in checked:
        assert "parameter(s) or buffer(s) differ from rank 0's" in result["error"], result
        assert "embed.weight (rank 1)" in result["error"] and "replicas='broadcast'" in result["error"]
    broadcast = launch("dist_workers:diverging_replicas", 2, {"replicas": "broadcast"}, timeout_s=180)
    assert broadcast[0]["digests"] and broadcast[0]["digests"] == broadcast[1]["digests"]


def test_experts_are_really_sharded_and_state_dict_round_trips():
    results = launch("dist_workers:shard_and_checkpoint", 2, {}, timeout_s=180)
    for r in results:
        assert r["local"] == r["full"] - r["expert_full"] // 2
        assert r["changed"] and r["restored"]
        assert "different expert placement" in r["mismatch_error"]


@pytest.mark.parametrize("spec", ["gpt-moe-tiny", pytest.param("hf:qwen3_moe", marks=pytest.mark.slow)])
def test_sequence_length_and_batch_may_change_between_calls(spec):
    """One captured graph, symbolic in batch and sequence length; each rank lowers new shapes
    on its own (ranks here even use different batch sizes at once) and stays exact."""
    from commfx.models.hf import choose_experts_implementation, training_forward

    sys.path.insert(0, str(Path(__file__).parent))
    results = launch("dist_workers:changing_shapes", 2, {"spec": spec}, timeout_s=300)
    model, _ = load_model(spec, dtype=torch.float64, batch=4, seq=16)
    choose_experts_implementation(model)
    for result in results:
        assert result["lowered"] == 3  # (4,16) is reused the second time
        for ids, got in result["outputs"]:
            with training_forward(model):
                out = model(ids)
            ref = out if isinstance(out, torch.Tensor) else out.logits
            assert got.shape == ref.shape and (got - ref).abs().max() <= 1e-10
            (ref.sum() / len(results)).backward()  # gradients are averaged over ranks, as with DDP
    for rank, result in enumerate(results):
        assert set(result["grads"]) == {n for n, p in model.named_parameters() if p.grad is not None}
        for name, param in model.named_parameters():
            expected = param.grad
            if name in result["placement"]:
                start, stop = result["placement"][name]
                expected = expected[start:stop]
            assert (result["grads"][name] - expected).abs().max() <= 1e-10, (rank, name)


@pytest.mark.parametrize("spec", ["gpt-moe-tiny", pytest.param("hf:qwen3_moe", marks=pytest.mark.slow)])
def test_a_rank_without_rows_takes_part_and_contributes_nothing(spec):
    """A global batch of 1 row on 2 ranks: rank 1 has no rows. It still runs every collective
    (on one stand-in row) and returns empty logits; the gradients (averaged over ranks) equal
    the single-process model's on the one row, halved."""
    from commfx.models.hf import choose_experts_implementation, training_forward

    sys.path.insert(0, str(Path(__file__).parent))
    results = launch("dist_workers:empty_rank", 2, {"spec": spec}, timeout_s=300)
    assert [r["rows"] for r in results] == [1, 0]
    assert results[1]["logits"].shape[0] == 0
    model, (ids,) = load_model(spec, dtype=torch.float64, batch=1)
    choose_experts_implementation(model)
    with training_forward(model):
        out = model(ids)
    ref = out if isinstance(out, torch.Tensor) else out.logits
    assert (results[0]["logits"] - ref).abs().max() <= 1e-10
    (ref.sum() / 2).backward()
    for result in results:
        for name, param in model.named_parameters():
            expected = param.grad
            if name in result["placement"]:
                start, stop = result["placement"][name]
                expected = expected[start:stop]
            assert (result["grads"][name] - expected).abs().max() <= 1e-10, (name, result["rows"])


@pytest.mark.parametrize(
    "spec, passes, tp",
    [
        pytest.param("hf:olmoe", "lift,expert_parallel,partition_a2a:k=2", 1, marks=pytest.mark.slow),
        pytest.param("hf:llama", "lift,tensor_parallel", 2, marks=pytest.mark.slow),
    ],
)
def test_new_inputs_recapture_and_share_parameters(spec, passes, tp):
    """distribute with input_ids only, then dm(input_ids=, labels=): the model is re-captured
    for the new inputs (rank 0 says so once) and HF's own loss comes back in its ModelOutput,
    equal to the single-process model's on each rank's rows, with the same gradients. Eval
    calls (no labels) and training calls then alternate on the two cached programs, which
    share the parameters: one SGD step over dm.parameters() reaches both."""
    from commfx.compiler.sharding import shard_index
    from commfx.models.hf import choose_experts_implementation, training_forward
    from commfx.verify import split_batch

    sys.path.insert(0, TESTS)
    results = launch("dist_workers:recapture_for_labels", 2, {"spec": spec, "passes": passes, "tp": tp}, timeout_s=300)
    model, (ids,) = load_model(spec, dtype=torch.float64, batch=4)
    choose_experts_implementation(model)
    dp = len(results) // tp

    def local(full, where):
        if isinstance(where, dict):
            return full.index_select(where["dim"], shard_index(where["layout"], where["part"], where["parts"]))
        return full[where[0] : where[1]]

    def reference(rank):
        with training_forward(model):
            return model(input_ids=split_batch(ids, dp, rank // tp), labels=split_batch(ids, dp, rank // tp))

    def check_grads(result, key):
        assert set(result[key]) == {n for n, p in model.named_parameters() if p.grad is not None}
        for name, param in model.named_parameters():
            expected = local(param.grad, result["placement"][name]) if name in result["placement"] else param.grad
            assert (result[key][name] - expected).abs().max() <= 1e-10, (key, name)

    outs = [reference(rank) for rank in range(len(results))]
    (sum(out.loss for out in outs[::tp]) / dp).backward()  # mean over data-parallel replicas, as DDP
    for rank, (result, out) in enumerate(zip(results, outs)):
        assert torch.equal(result["rows"], split_batch(ids, dp, rank // tp))
        assert result["type"] == type(out).__name__
        assert (result["loss"] - out.loss).abs() <= 1e-10
        assert (result["logits"] - out.logits).abs().max() <= 1e-10
        assert (result["first_eval"] - out.logits).abs().max() <= 1e-10
        check_grads(result, "grads")
        assert result["captures"] == [["input_ids"], ["input_ids", "labels"]]  # eval and train again: cached
        assert result["same_parameters"] and result["own_parameters"] and result["same_keys"]
        assert result["placement"] and not result["full_alive"]  # no full-size sharded parameter was kept
    assert results[0]["stderr"].count("re-capturing") == 1 and "(input_ids, labels)" in results[0]["stderr"]
    assert all("re-capturing" not in r["stderr"] for r in results[1:])

    with torch.no_grad():  # the step the worker took: SGD, lr 0.5
        for param in model.parameters():
            if param.grad is not None:
                param -= 0.5 * param.grad
    model.zero_grad(set_to_none=True)
    outs = [reference(rank) for rank in range(len(results))]
    (sum(out.loss for out in outs[::tp]) / dp).backward()
    for result, out in zip(results, outs):
        assert (result["eval_after"] - out.logits).abs().max() <= 1e-10
        assert (result["loss_after"] - out.loss).abs() <= 1e-10
        check_grads(result, "grads_after")


def test_new_inputs_are_refused_by_passes_with_state_keyed_by_op():
    """pack_experts and defer_grad_sync keep runtime state of the first program: new inputs are
    an error naming the pass. So are a module past max_captures and ranks that disagree."""
    sys.path.insert(0, TESTS)
    cases = ["lift,expert_parallel,pack_experts", "lift,expert_parallel,defer_grad_sync"]
    for errors in launch("dist_workers:recapture_refused", 2, {"cases": cases}, timeout_s=300):
        assert "re-capture for new inputs is not supported with pack_experts" in errors[cases[0]].lower()
        assert "re-capture for new inputs is not supported with defer_grad_sync" in errors[cases[1]].lower()
        assert "the call adds labels" in errors[cases[0]]
        assert "max_captures" in errors["max_captures"] and "(input_ids)" in errors["max_captures"]
        assert "every rank must make the same call" in errors["spmd"]
        assert "(attention_mask, input_ids)" in errors["spmd"] and "(input_ids, labels)" in errors["spmd"]
