"""Plans are validated before tracing, with messages that say what is wrong and how to fix it."""

import pytest
import torch

from commfx.models import load_model
from commfx.compiler.pass_manager import check_plan
from commfx.passes import plan_options
from commfx.plan import PassSpec, Plan, PlanError, Topology


def gpt(**kw):
    return load_model("gpt-moe", **kw)[0]


def test_pass_spec_parses_options():
    spec = PassSpec.parse("expert_parallel:capacity_factor=1.5")
    assert spec == PassSpec("expert_parallel", {"capacity_factor": "1.5"})
    plan = Plan.from_cli("lift,expert_parallel:capacity_factor=1.5", world_size=2)
    assert plan_options(plan, "expert_parallel").capacity_factor == 1.5


def test_unknown_pass_lists_registered_ones():
    with pytest.raises(PlanError, match=r"unknown pass 'nope'.*lift, expert_parallel"):
        check_plan(Plan.from_cli("lift,nope", world_size=2))


def test_unknown_option_lists_valid_options():
    with pytest.raises(PlanError, match=r"has no option speed; its options are: capacity_factor"):
        check_plan(Plan.from_cli("lift,expert_parallel:speed=3", world_size=2))


def test_option_of_wrong_type():
    with pytest.raises(PlanError, match=r"capacity_factor='fast'.*must be of type float"):
        check_plan(Plan.from_cli("lift,expert_parallel:capacity_factor=fast", world_size=2))


def test_pass_order_is_checked():
    with pytest.raises(PlanError, match=r"needs lift before it; for example --passes lift,expert_parallel"):
        check_plan(Plan.from_cli("expert_parallel", world_size=2))


def test_experts_not_divisible_by_ep():
    model = gpt(num_experts=6)
    with pytest.raises(PlanError, match=r"has 6 experts, which do not divide evenly over expert-parallel size 4"):
        check_plan(Plan.from_cli("lift,expert_parallel", world_size=4), model)


def test_ep_must_divide_world():
    with pytest.raises(PlanError, match=r"expert-parallel size 3 must divide the world size 4; choose ep from \[1, 2, 4\]"):
        check_plan(Plan(Topology(world_size=4, ep=3)))


def test_expert_parallel_on_model_without_moe():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(PlanError, match=r"expert_parallel was requested but Sequential has no MoE block"):
        check_plan(Plan.from_cli("lift,expert_parallel", world_size=2), mlp)


def test_process_groups_of_a_topology():
    groups = Topology(world_size=4, ep=2).process_groups()
    assert groups == {
        "world": [[0, 1, 2, 3]],
        "ep": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]],
        "tp": [[0], [1], [2], [3]],
        "pp": [[0], [1], [2], [3]],
        "dp": [[0, 1, 2, 3]],
    }


def test_process_groups_with_a_pipeline():
    """rank = pp_idx * dp + dp_idx (tp = 1): stages are blocks of consecutive ranks; ep lives inside dp."""
    topology = Topology(world_size=8, pp=2, ep=2)
    groups = topology.process_groups()
    assert list(groups) == ["world", "ep", "edp", "tp", "pp", "dp", "pp_ends", "pp_ends_dp"]
    assert groups["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp_ends_dp"] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert topology.coordinates(6) == (1, 2, 0) and topology.rank_of(1, 2) == 6
    assert Topology(world_size=4, pp=2).expert_parallel_size == 2


def test_pipeline_size_must_divide_the_world():
    with pytest.raises(PlanError, match=r"pipeline-parallel size 3 must divide the world size 4; choose pp from \[1, 2, 4\]"):
        Topology(world_size=4, pp=3).validate()
    with pytest.raises(PlanError, match=r"expert-parallel size 4 must divide the ranks of a pipeline stage, 2 \(world 4 / pp 2\)"):
        Topology(world_size=4, pp=2, ep=4).validate()
