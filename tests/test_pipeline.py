"""Pipeline parallelism: the split, the schedules, and float64 equality.

The split program equals the model in one process; on gloo ranks a pipeline (GPipe and
1F1B, pp x dp, expert parallelism inside stages, a weight tied across the first and last
stage) equals the single-process reference in outputs and every gradient, and equals
torch.distributed.pipelining's schedules on the same micro-batches.
"""

import sys
from pathlib import Path

import pytest
import torch

from commfx.compiler.pipeline import compile_program
from commfx.compiler.render import render_pipeline
from commfx.models import load_model
from commfx.compiler.pass_manager import check_plan
from commfx.passes.base import PassError
from commfx.passes.pipeline_split import balance_by_count, balance_by_flops, find_layers
from commfx.plan import Plan, PlanError, Topology
from commfx.runtime.comm import install_default, local_scheduler
from commfx.runtime.launcher import launch
from commfx.runtime.pipeline.schedule import actions, critical_backwards
from commfx.verify import VerifyCase, verify
from golden_files import check_golden

TESTS = Path(__file__).parent
TIED = f"{TESTS / 'model_files' / 'tied_pipeline.py'}:build"


def split(passes="lift,pipeline_split", pp=2, model="gpt-moe", **kwargs):
    model, inputs = load_model(model, dtype=torch.float64, **kwargs)
    program = compile_program(model, Plan.from_cli(passes, world_size=pp, pp=pp), inputs)
    return model, inputs, program


# ------------------------------------------------------------------------ schedules


def test_schedules_follow_gpipe_and_1f1b():
    order = lambda *args: " ".join(map(str, actions(*args)))  # noqa: E731
    assert order("gpipe", 0, 2, 3) == "F0 F1 F2 B0 B1 B2"
    assert order("1f1b", 0, 2, 4) == "F0 F1 B0 F2 B1 F3 B2 B3"  # one warm-up forward
    assert order("1f1b", 1, 2, 4) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert order("1f1b", 0, 4, 2) == "F0 F1 B0 B1"  # fewer micro-batches than the warm-up
    # Optimus-CC's epilogue: backwards after the stage's last forward (cool-down + last steady one)
    assert critical_backwards("1f1b", 1, 4, 8) == {5, 6, 7}
    assert critical_backwards("1f1b", 3, 4, 8) == {7}
    assert critical_backwards("gpipe", 1, 2, 3) == {0, 1, 2}
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        actions("zb", 0, 2, 2)


# ------------------------------------------------------------------------ the split, one process


def test_split_program_equals_the_model():
    model, inputs, program = split(num_layers=3)
    pipeline = program.regions.pipeline
    assert [s.layers for s in pipeline.stages] == [[0, 1], [2]]
    assert pipeline.boundaries[0].names == ["h_4"] and pipeline.boundaries[0].tensors[0].requires_grad
    install_default(local_scheduler())
    out = program.gm(*inputs)[0]
    out.sum().backward()
    reference = model(*inputs)
    assert (out - reference).abs().max().item() <= 1e-12
    stage_params = {n: p for s in pipeline.stages for n, p in s.gm.named_parameters()}
    assert set(stage_params) == {n for n, _ in model.named_parameters()}
    assert all(stage_params[n] is p for n, p in model.named_parameters())  # the stages hold the model's own weights


def test_flops_balance_moves_layers_off_a_heavy_head():
    """A large vocabulary makes the head cost more than a layer: the FLOP balance gives the
    last stage fewer layers than the count balance does."""
    model, inputs = load_model("gpt-moe", num_layers=4, vocab_size=4096)
    graph = compile_program(model, Plan.from_cli("lift", world_size=1), inputs).graph
    _, layer_of = find_layers(graph)
    assert balance_by_count(4, 2) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert balance_by_flops(graph, layer_of, 2) == {0: 0, 1: 0, 2: 0, 3: 1}
    assert balance_by_flops(graph, layer_of, 4) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_tied_weight_is_held_by_both_ends():
    from commfx.models import load_model as load

    model, inputs = load(TIED, dtype=torch.float64)
    program = compile_program(model, Plan.from_cli("lift,pipeline_split", world_size=2, pp=2), inputs)
    assert program.regions.pipeline.shared == {"embed.weight": [0, 1]}


def test_golden_stages_and_boundaries():
    model, inputs = load_model("gpt-moe")
    program = compile_program(model, Plan.from_cli("lift,pipeline_split", world_size=2, pp=2), inputs)
    check_golden("gpt-moe.pp2.stages", render_pipeline(program.regions.pipeline))


# ------------------------------------------------------------------------ errors, before any rank starts


def test_clear_errors():
    model, inputs = load_model("gpt-moe")  # two layers
    with pytest.raises(PlanError, match=r"GPTMoE has 2 layer\(s\) to deal out but the plan asks for 4 pipeline stages"):
        check_plan(Plan.from_cli("lift,pipeline_split", world_size=4, pp=4), model)
    with pytest.raises(PlanError, match=r"pipeline-parallel size 3 must divide the world size 4"):
        check_plan(Plan.from_cli("lift,pipeline_split", world_size=4, pp=3), model)
    with pytest.raises(PlanError, match=r"needs at least 2 pipeline stages; set the pipeline-parallel size \(--pp 2\)"):
        check_plan(Plan.from_cli("lift,pipeline_split", world_size=2), model)
    with pytest.raises(PlanError, match=r"schedule='zb' is not one of 1f1b, gpipe"):
        check_plan(Plan.from_cli("lift,pipeline_split:schedule=zb", world_size=2, pp=2), model)
    with pytest.raises(PassError, match=r"8 rows, which do not cut into 3 equal micro-batches; choose pipeline_split:microbatches from \[1, 2, 4, 8\]"):
        compile_program(model, Plan.from_cli("lift,pipeline_split:microbatches=3", world_size=2, pp=2), inputs)


def test_cli_errors_before_ranks(capsys):
    from commfx.cli.main import main

    assert main(["verify", "gpt-moe", "--world-size", "2", "--pp", "4", "--passes", "lift,pipeline_split"]) == 2
    assert "pipeline-parallel size 4 must divide the world size 2" in capsys.readouterr().out


# ------------------------------------------------------------------------ gloo ranks, float64


@pytest.mark.distributed
def test_pipeline_equals_the_model_world_2():
    cases = [
        VerifyCase("gpt-moe", Plan.from_cli("lift,pipeline_split", world_size=2, pp=2), batch=4, seq=8),
        VerifyCase("gpt-moe", Plan.from_cli("lift,pipeline_split:schedule=gpipe;microbatches=4", world_size=2, pp=2), batch=4, seq=8),
        VerifyCase(TIED, Plan.from_cli("lift,pipeline_split:microbatches=2", world_size=2, pp=2)),
    ]
    for report in verify(cases, 2, timeout_s=300):
        assert report.ok, (report.case.plan.passes, report.failures, report.max_diff)
        assert report.max_diff <= 1e-10
        assert len(report.grad_diffs) == len(dict(load_model(report.case.model)[0].named_parameters()))


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_times_data_parallel_with_experts_world_4():
    """pp=2 x dp=2, experts sharded over the 2 ranks of each stage, a tied-free MoE model."""
    plan = Plan.from_cli("lift,expert_parallel,pipeline_split", world_size=4, pp=2)
    (report,) = verify([VerifyCase("gpt-moe", plan, batch=4, seq=4)], 4, timeout_s=300)
    assert report.ok, (report.failures, report.max_diff)
    assert report.tokens_per_rank == [8, 8, 8, 8]  # every stage of a replica sees its replica's half


@pytest.mark.distributed
def test_pipeline_equals_torch_distributed_pipelining():
    sys.path.insert(0, str(TESTS))
    results = launch("pipeline_workers:against_torch_pipelining", 2, {"microbatches": 2}, timeout_s=300)
    for rank, result in enumerate(results):
        for schedule in ("gpipe", "1f1b"):
            r = result[schedule]
            assert set(r["ours"]) == set(r["theirs"]) and r["ours"]
            for name, grad in r["ours"].items():
                assert (grad - r["theirs"][name]).abs().max().item() <= 1e-10, (schedule, rank, name)
            if rank == 1:
                assert len(r["ours_losses"]) == len(r["their_losses"]) == 2
                for a, b in zip(r["ours_losses"], r["their_losses"]):
                    assert abs(a.item() - b.item()) <= 1e-12


def test_topology_validation_of_pipelines():
    assert Topology(world_size=4, pp=2).dp == 2
    assert Plan(Topology(world_size=4, pp=2)).grad_scale == 0.5


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_equals_the_model_pp_4_world_4():
    """Four stages, one layer each, in float64: GPipe on gpt-moe, and 1F1B (warm-up depths
    3, 2, 1 and 0 forwards) on a model whose weight is tied across stage 0 and stage 3."""
    four = TESTS / "model_files" / "four_stage.py"
    cases = [
        VerifyCase(f"{four}:gpt_moe", Plan.from_cli("lift,pipeline_split:schedule=gpipe;microbatches=2", world_size=4, pp=4)),
        VerifyCase(f"{four}:tied", Plan.from_cli("lift,pipeline_split:schedule=1f1b;microbatches=4", world_size=4, pp=4)),
    ]
    for report in verify(cases, 4, timeout_s=300):
        assert report.ok, (report.case.model, report.case.plan.passes, report.failures, report.max_diff)
        assert report.max_diff <= 1e-10
        assert len(report.grad_diffs) == len(dict(load_model(report.case.model)[0].named_parameters()))
