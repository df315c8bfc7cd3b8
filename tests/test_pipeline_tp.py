"""3D parallelism: tensor parallelism inside pipeline stages (pp x tp, x dp, x ep).

Single-process tests check that each stage's graph carries its blocks' tp collectives on
the `tp` group, that boundaries carry whole (replicated) activations, that ranks and
groups line up (a tp rank's counterpart in the next stage has its tp index) and which
pairings are refused; the gloo tests (slow: worlds 4 and 8 on two cores) check float64
equality with the single-process model on a dense and an MoE HF model (pp 2 x tp 2) and on
gpt-moe with experts (pp 2 x tp 2 x dp 2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commfx.compiler.pass_manager import check_plan
from commfx.compiler.pipeline import compile_program
from commfx.compiler.render import render_pipeline
from commfx.compiler.sharding import shard_parameters
from commfx.models import load_model
from commfx.plan import Plan, PlanError, Topology
from commfx.verify import VerifyCase, verify
from golden_files import check_golden

commfx = torch.ops.commfx
TP_OPS = (commfx.tp_copy.default, commfx.all_reduce.default)


def _split(passes: str = "lift,tensor_parallel,pipeline_split", world: int = 4, pp: int = 2, tp: int = 2):
    model, inputs = load_model("gpt-moe-tiny", num_layers=2)
    return compile_program(model, Plan.from_cli(passes, world_size=world, pp=pp, tp=tp), inputs)


def test_stages_carry_their_blocks_tp_collectives_on_the_tp_group():
    program = _split()
    pipeline = program.regions.pipeline
    shards = program.runtime.shards
    for stage in pipeline.stages:
        ops = [n for n in stage.gm.graph.nodes if n.target in TP_OPS]
        # gpt-moe-tiny splits attention (its MLPs are MoE): one tp_copy and one all-reduce per layer
        assert [n.target for n in ops] == [commfx.tp_copy.default, commfx.all_reduce.default] * len(stage.layers)
        assert {n.args[1] for n in ops} == {"tp"}
        split = [p for p in stage.parameters if p in shards]
        assert split == [f"layers.{i}.attn.{w}.weight" for i in stage.layers for w in ("qkv", "proj")]
    # boundaries carry the whole activation, replicated over the tp group
    unsplit = _split("lift,pipeline_split", tp=1).regions.pipeline
    assert [[t.shape for t in b.tensors] for b in pipeline.boundaries] == [[t.shape for t in b.tensors] for b in unsplit.boundaries]
    check_golden("gpt-moe-tiny-2l.pp2.tp2.stages", render_pipeline(pipeline))


def test_a_stage_holds_its_tp_index_share():
    program = _split()
    stage = program.regions.pipeline.stages[1]
    full = dict(stage.gm.named_parameters())["layers.1.attn.qkv.weight"].detach().clone()
    shards = {t: s for t, s in program.runtime.shards.items() if t in stage.parameters}
    view = dataclasses.replace(program, gm=stage.gm, runtime=dataclasses.replace(program.runtime, shards=shards))  # as distribute cuts a stage
    placement = shard_parameters(view, {"tp": 1, "ep": 0, "dp": 0, "pp": 1})
    local = dict(stage.gm.named_parameters())["layers.1.attn.qkv.weight"]
    assert placement["layers.1.attn.qkv.weight"]["part"] == 1 and local.shape[0] == full.shape[0] // 2
    assert torch.equal(local, full.view(3, 4, 4, -1)[:, 2:].reshape(-1, full.shape[1]))  # heads 2, 3 of q, k and v


def test_ranks_of_pp_times_tp_times_dp():
    groups = Topology(world_size=8, pp=2, tp=2).process_groups()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # each tp rank sends to its counterpart
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert Plan(Topology(world_size=8, pp=2, tp=2)).grad_scale_for("edp") == 1 / 4


def test_refused_pairings_say_why():
    with pytest.raises(PlanError, match=r"pipeline_split does not work with resize_tp yet: .*use resize_tp with --pp 1"):
        check_plan(Plan.from_cli("lift,tensor_parallel,resize_tp,pipeline_split", world_size=4, pp=2, tp=2))
    with pytest.raises(PlanError, match=r"resize_tp does not work with pipeline_split yet"):
        check_plan(Plan.from_cli("lift,tensor_parallel,pipeline_split,resize_tp", world_size=4, pp=2, tp=2))
    with pytest.raises(PlanError, match=r"microbatch_overlap does not work with pipeline_split yet"):
        check_plan(Plan.from_cli("lift,expert_parallel,tensor_parallel,pipeline_split,microbatch_overlap", world_size=4, pp=2, tp=2))
    with pytest.raises(PlanError, match=r"pipeline_split does not work with split_embedding_comm yet: .*use it with --pp 1"):
        check_plan(Plan.from_cli("lift,split_embedding_comm,tensor_parallel,pipeline_split", world_size=4, pp=2, tp=2))


@pytest.mark.slow
def test_pp2_tp2_equals_the_single_process_model_world_4():
    cases = [
        VerifyCase("hf:llama", Plan.from_cli("lift,tensor_parallel,pipeline_split", world_size=4, pp=2, tp=2)),
        VerifyCase("hf:mixtral", Plan.from_cli("lift,expert_parallel,tensor_parallel,pipeline_split", world_size=4, pp=2, tp=2)),
    ]
    for report in verify(cases, 4, timeout_s=500):
        assert report.ok, (report.case.model, report.failures, report.grad_diffs)
        assert report.max_diff <= 1e-10


@pytest.mark.slow
def test_pp2_tp2_dp2_with_experts_equals_the_single_process_model_world_8():
    plan = Plan.from_cli("lift,expert_parallel,tensor_parallel,pipeline_split", world_size=8, pp=2, tp=2)  # ep 4 per stage
    (report,) = verify([VerifyCase("gpt-moe", plan)], 8, timeout_s=600)
    assert report.ok, (report.failures, report.grad_diffs)
    assert report.max_diff <= 1e-10
