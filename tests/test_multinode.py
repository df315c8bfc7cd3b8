"""Several machines under torchrun: the plan's nodes are torchrun's (set here by hand)."""

from __future__ import annotations

import pytest

from commfx.passes import check_plan
from commfx.plan import Plan, PlanError, Topology

TORCHRUN_VARS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "RANK", "GROUP_RANK")
LOCMOE = "lift,locality_gate:max_remote_fraction=0.3,expert_parallel,hierarchical_a2a"


def torchrun_env(monkeypatch, **values: int) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_topology_defaults_come_from_torchrun(monkeypatch):
    """2 nodes x 2 ranks: world and ranks per node from torchrun, so the LocMoE passes plan for them."""
    torchrun_env(monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2, RANK=3, GROUP_RANK=1)
    plan = Plan.from_cli(LOCMOE)
    assert (plan.topology.world_size, plan.topology.ranks_per_node) == (4, 2)
    assert Plan.from_cli(LOCMOE, world_size=4).topology == plan.topology
    assert Plan.from_cli(LOCMOE, world_size=4, ranks_per_node=2).topology == plan.topology
    check_plan(plan)
    assert [plan.topology.node_of(r) for r in range(4)] == [0, 0, 1, 1]


def test_ranks_per_node_that_disagrees_with_torchrun_is_a_plan_error(monkeypatch):
    torchrun_env(monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2, RANK=0, GROUP_RANK=0)
    with pytest.raises(PlanError, match=r"ranks_per_node=4 disagrees with torchrun's LOCAL_WORLD_SIZE=2"):
        Plan.from_cli(LOCMOE, ranks_per_node=4)
    with pytest.raises(PlanError, match=r"ranks_per_node=1 disagrees with torchrun's LOCAL_WORLD_SIZE=2"):
        Plan.from_cli(LOCMOE, world_size=4, ranks_per_node=1)


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(WORLD_SIZE=3, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2), r"torchrun started 3 ranks \(WORLD_SIZE\) on 2 nodes .* this node has 2"),
        (dict(WORLD_SIZE=4, LOCAL_WORLD_SIZE=1, GROUP_WORLD_SIZE=2), r"on 2 nodes \(GROUP_WORLD_SIZE\), but this node has 1 .*same --nproc-per-node"),
        (dict(WORLD_SIZE=5, LOCAL_WORLD_SIZE=2), r"torchrun started 5 ranks \(WORLD_SIZE\), but this node has 2 \(LOCAL_WORLD_SIZE\)"),
        (dict(WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, RANK=2, GROUP_RANK=0), r"rank 2 is on torchrun's node 0 \(GROUP_RANK\), not node 1"),
    ],
)
def test_nodes_of_unequal_size_are_a_plan_error(monkeypatch, env, message):
    torchrun_env(monkeypatch, **env)
    with pytest.raises(PlanError, match=message):
        Plan.from_cli(LOCMOE)


def test_without_torchrun_the_topology_is_as_given(monkeypatch):
    torchrun_env(monkeypatch)
    assert Plan.from_cli(LOCMOE, world_size=4).topology == Topology(world_size=4)
    assert Plan.from_cli(LOCMOE, world_size=4, ranks_per_node=2).topology == Topology(world_size=4, ranks_per_node=2)
    with pytest.raises(PlanError, match=r"no world size: pass world_size=\.\.\., or run under torchrun"):
        Plan.from_cli(LOCMOE)
    with pytest.raises(PlanError, match=r"locality_gate routes by node, but this plan has no nodes"):
        check_plan(Plan.from_cli(LOCMOE, world_size=4))


def test_a_plan_for_another_world_takes_nothing_from_torchrun(monkeypatch):
    """A single-process reference built inside a rank keeps one node."""
    torchrun_env(monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2, RANK=1, GROUP_RANK=0)
    assert Plan.from_cli("lift", world_size=1).topology == Topology(world_size=1)


def test_one_torchrun_node_is_one_node(monkeypatch):
    """`--standalone --nproc-per-node 2`: the LocMoE passes say there is one node."""
    torchrun_env(monkeypatch, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=1, RANK=0, GROUP_RANK=0)
    plan = Plan.from_cli(LOCMOE)
    assert plan.topology.ranks_per_node == 2
    with pytest.raises(PlanError, match=r"locality_gate routes by node, but this plan has one node holding all ep=2 ranks"):
        check_plan(plan)
