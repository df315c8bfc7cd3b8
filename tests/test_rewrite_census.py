"""Every pass of a plan must leave something behind: verify fails a plan with a no-op pass.

The census is taken right after each pass runs (`run_passes`), so a later pass that
rewrites an earlier one's nodes (pack_experts over expert_parallel) does not hide it.
"""

import pytest
import torch

from commfx.compiler.pipeline import compile_program
from commfx.models import load_model
from commfx.compiler.pass_manager import no_op_passes, rewrite_census
from commfx.passes.partition_a2a import PartitionA2A
from commfx.plan import Plan
from commfx.verify import VerifyCase, VerifyReport


def _census(passes: str, model: str = "gpt-moe-tiny", **topology):
    model, inputs = load_model(model, dtype=torch.float64)
    plan = Plan.from_cli(passes, **topology)
    return plan, rewrite_census(compile_program(model, plan, inputs), plan)


def test_each_pass_is_credited_with_what_it_inserted():
    _, census = _census("lift,expert_parallel,pack_experts,partition_a2a:k=2,microbatch_overlap,defer_grad_sync", world_size=2)
    assert census["expert_parallel"]["commfx.all_to_all"] == 2, "pack_experts rewrote them later; the census keeps them"
    assert census["pack_experts"]["commfx.rank_dispatch"] == 1 and census["pack_experts"]["commfx.packed_expert_ffn"] == 1
    assert census["partition_a2a"]["commfx.all_to_all"] == 4 and census["partition_a2a"]["commfx.split_chunks"] == 1
    assert census["microbatch_overlap"]["tensor_split"] == 1
    assert census["defer_grad_sync"] == {"grad_sync: next_forward": 1}
    assert not no_op_passes(census)


def test_annotation_passes_count_their_work():
    _, census = _census("lift,pipeline_split,compress_pipeline", "gpt-moe", world_size=2, pp=2)
    assert census["pipeline_split"] == {"stages": 2, "boundaries": 1}
    assert census["compress_pipeline"] == {"boundary codecs": 1}
    _, census = _census("lift,expert_parallel,locality_gate,hierarchical_a2a", world_size=4, ranks_per_node=2)
    assert census["hierarchical_a2a"] == {"a2a_algorithm: hierarchical": 1}
    assert census["locality_gate"]["commfx.locality_topk"] == 1


def test_a_pass_that_does_nothing_fails_verify(monkeypatch):
    monkeypatch.setattr(PartitionA2A, "run", lambda self, program, options, plan: False)
    plan, census = _census("lift,expert_parallel,partition_a2a:k=2", world_size=2)
    assert census["partition_a2a"] == {} and no_op_passes(census) == ["partition_a2a"]
    report = VerifyReport(VerifyCase("gpt-moe-tiny", plan), 0.0, {"w": 0.0}, 0.0, 1e-10, rewrites=census)
    assert not report.ok and report.failures == ["pass partition_a2a changed nothing"]
