"""Hierarchical all-to-all (DeepEP forwarding, Tutel 2DH): bit for bit the flat all-to-all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from commfx.compiler.pass_manager import check_plan
from commfx.plan import Plan, PlanError
from commfx.runtime.hierarchical_a2a import NodeLayout, unique_rows
from commfx.verify import VerifyCase, verify


def test_forwarders_pair_ranks_of_the_same_local_index():
    layout = NodeLayout((0, 0, 1, 1))
    assert [layout.forwarder(s, 1) for s in (0, 1)] == [2, 3]
    assert [layout.deliverer(s, 3) for s in range(4)] == [2, 3, 2, 3]  # rank 0 via its rail peer 2; same node: the source itself
    uneven = NodeLayout((0, 0, 0, 1))
    assert [uneven.forwarder(s, 1) for s in (0, 1, 2)] == [3, 3, 3]


def test_unique_rows_compare_bits():
    rows = torch.tensor([[0.0, 1.0], [-0.0, 1.0], [0.0, 1.0], [float("nan"), 1.0], [float("nan"), 1.0]])
    unique, index = unique_rows(rows)
    assert unique.shape[0] == 3  # 0.0 and -0.0 stay apart, the two NaN rows merge
    assert torch.equal(unique[index.long()].view(torch.int32), rows.view(torch.int32))


@pytest.mark.distributed
def test_hierarchical_equals_flat_bit_for_bit_at_2_nodes_by_2_ranks():
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    ranks = launch("locmoe_workers:hierarchical_vs_flat", 4, {"ranks_per_node": 2}, timeout_s=180)
    for rank, cases in enumerate(ranks):
        for name, result in cases.items():
            assert result["equal"], (rank, name)
    # Dispatch rows are token copies: a token bound for both ranks of the other node crosses once.
    dispatch = [cases["dispatch float64"] for cases in ranks]
    assert sum(r["hier_inter"] for r in dispatch) < sum(r["flat_inter"] for r in dispatch)
    assert all(cases["all empty"]["rows"] == 0 for cases in ranks)
    assert ranks[1]["uneven and empty"]["flat_inter"] == 0


@pytest.mark.distributed
def test_expert_parallel_with_hierarchical_a2a_equals_the_model_at_world_4():
    """Outputs and every gradient (the backward all-to-alls run hierarchically too) <= 1e-10."""
    plan = Plan.from_cli("lift,expert_parallel,hierarchical_a2a", world_size=4, ranks_per_node=2)
    (report,) = verify([VerifyCase("gpt-moe", plan, batch=6)], 4, timeout_s=600)
    assert report.ok, (report.failures, report.max_diff)


@pytest.mark.parametrize("ranks_per_node", [0, 4])
def test_a_plan_without_nodes_is_a_clear_error(ranks_per_node):
    plan = Plan.from_cli("lift,expert_parallel,hierarchical_a2a", world_size=4, ranks_per_node=ranks_per_node)
    with pytest.raises(PlanError, match="spans nodes"):
        check_plan(plan)
