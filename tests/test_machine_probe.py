"""Plan(machine="measure"): the cost models read figures timed on the ranks (runtime/machine_probe.py)."""

import dataclasses
import re

import pytest

from commfx.plan import Plan, PlanError, Topology
from commfx.runtime.launcher import launch
from commfx.runtime.machine_probe import MachineFigures, measured_topology


def test_an_unknown_machine_setting_is_a_plan_error():
    with pytest.raises(PlanError, match="machine must be one of given, measure"):
        dataclasses.replace(Plan.from_cli("lift", world_size=2), machine="guess").validate()


def test_measured_figures_replace_the_ones_the_cost_models_read():
    topology = Topology(world_size=4, ranks_per_node=2)
    across = measured_topology(topology, MachineFigures(2e10, 2e-3, 6.25e6, spans_nodes=True))
    # two ranks share a node's link: the node's bandwidth is twice a rank's share
    assert (across.flops_per_s, across.collective_overhead_s, across.inter_node_bandwidth) == (2e10, 2e-3, 12.5e6)
    assert across.chunk_overhead_s == 2e-3  # one more chunk costs one more collective
    # ... and its host work, where the caller gives the device's figure (distribute does)
    assert measured_topology(topology, MachineFigures(2e10, 2e-3, 6.25e6, spans_nodes=True), 1e-3).chunk_overhead_s == pytest.approx(3e-3)
    assert across.inter_node_latency_s == 0.0 and across.intra_node_bandwidth == topology.intra_node_bandwidth
    within = measured_topology(Topology(world_size=2), MachineFigures(5e10, 5e-4, 6e8, spans_nodes=False))
    assert within.intra_node_bandwidth == 6e8 and within.inter_node_bandwidth == Topology(world_size=2).inter_node_bandwidth


@pytest.mark.distributed
def test_every_rank_compiles_with_the_same_measured_figures():
    results = launch("dist_workers:measured_machine", 2, {}, timeout_s=240)
    notes = [r["notes"] for r in results]
    assert notes[0] == notes[1] and len(notes[0]) == 1, notes  # agreed: the same figures, so the same graph
    rate, per_call, link = (float(v.replace(",", "")) for v in re.findall(r"([\d,.]+) (?:GFLOP/s|ms|Mbit/s)", notes[0][0]))
    assert rate > 0.1 and per_call > 0 and link > 0, notes[0]
    assert results[0]["chunks"] == results[1]["chunks"] and results[0]["chunks"], results
    assert all(r["probe_bytes"] == 0 for r in results), "the probe's all-to-alls are not counted as the model's traffic"
