"""commfx simulate and plan with split_embedding_comm:schedule=2d (simulate/rows.py): the row
exchange leaves the backward, runs into the next step (next-batch rows ahead of the gradient
all-reduce, the rest behind it); the next forward's lookup waits only for the next-batch rows
and the rest is stepped before the optimizer step; the engine runs two steps and reports the
second. On a communication-bound config the 2d step is shorter than
the step schedule's, where compute dominates it is close, and commfx plan offers and ranks it.

The model (tests/model_files/late_lookup.py) reads its table after dense layers, so there is
forward compute for the exchange to overlap. The cluster is the emulated one with an NCCL-like
launch cost per collective (20 us): gloo's fitted 0.5 ms would charge the three small exchanges
schedule=2d adds per table more than the overlap saves on a model this small.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from commfx.plan import Plan
from commfx.simulate import Captures, load_cluster, simulate
from commfx.simulate.search import Candidate, Facts, extensions, search

MODEL = f"{Path(__file__).parent / 'model_files' / 'late_lookup.py'}:build"
CAPTURES = Captures()  # one trace of the model for every test here


def _cluster(link: str):
    return dataclasses.replace(load_cluster("emulated").with_layout(2, 1, link), collective_overhead_s=20e-6)


def _both(strategy: str, link: str):
    cluster = _cluster(link)
    base = f"lift,split_embedding_comm:strategy={strategy}"
    return [simulate(MODEL, Plan.from_cli(p, world_size=2, ranks_per_node=1), cluster, captures=CAPTURES).result
            for p in (base, f"{base};schedule=2d")]


@pytest.mark.parametrize("strategy", ["sparse", "shard"])
def test_on_a_communication_bound_config_the_2d_step_is_shorter(strategy):
    step, later = _both(strategy, "300mbit")
    assert step.comm_s > step.compute_s  # the premise: communication-bound
    assert later.step_s < step.step_s and later.exposed_comm_s < step.exposed_comm_s
    assert later.inter_node_bytes >= step.inter_node_bytes  # the same rows (and a little more) still cross: nothing is free
    # the step schedule waits for the rows inside its backward; 2d does not, and the step is the second of two
    assert len(step.timeline.steps) == 1 and len(later.timeline.steps) == 2
    rows = [p for p in later.history if p.priority in ("rows_next", "rows_later")]
    assert {p.priority for p in rows} == {"rows_next", "rows_later"}
    first_end = later.timeline.steps[0][2]
    assert any(p.t_submit < first_end for p in rows) and any(p.t_submit >= first_end for p in rows)
    # closer to max(compute, wire) than the step schedule, which pays about their sum
    assert later.step_s - max(later.compute_s, later.comm_s) < step.step_s - max(step.compute_s, step.comm_s)


@pytest.mark.parametrize("strategy", ["sparse", "shard"])
def test_where_compute_dominates_the_2d_step_is_close(strategy):
    step, later = _both(strategy, "10gbit")
    assert step.compute_s > 5 * step.comm_s  # the premise: compute-dominated
    assert abs(later.step_s - step.step_s) <= 0.08 * step.step_s


def test_on_a_slow_link_the_next_lookup_does_not_wait_for_the_other_rows():
    """At 20 Mbit/s the first step's other rows (rows_later, behind the gradient all-reduce)
    arrive after the second step's lookup, which steps the rows it reads without waiting;
    the rest of the table is stepped once they are in, before the optimizer step."""
    _, later = _both("sparse", "20mbit")
    second = later.timeline.steps[1][1]
    spans = [s for s in later.timeline.spans if s.start >= second]
    lookup = next(s for s in spans if s.op == "step table.weight")
    rest = next(s for s in spans if s.op == "step table.weight (other rows)")
    optimizer = next(s for s in spans if s.op == "optimizer step")
    arrived = max(p.t_done for p in later.history if p.priority == "rows_later" and p.t_submit < second)
    assert lookup.end < arrived <= rest.start < optimizer.start
    assert not [s for s in spans if s.blocked and s.op == "wait for rows"]


def test_plan_offers_schedule_2d_and_ranks_it_by_the_simulated_step():
    cluster = _cluster("300mbit")
    grown = [c.passes for c in extensions(Candidate("lift,expert_parallel"), "embedding", Facts(8, 2, untied_tables=1), cluster)]
    assert grown == ["lift,expert_parallel", "lift,expert_parallel,split_embedding_comm",
                     "lift,expert_parallel,split_embedding_comm:schedule=2d"]
    assert extensions(Candidate("lift"), "embedding", Facts(untied_tables=0), cluster) == [Candidate("lift")]
    result = search(MODEL, cluster, memory_limit=cluster.device.memory_bytes)
    steps = {r.candidate.command_args(): r.step_s for r in result.fitting}
    later, step = "--passes lift,split_embedding_comm:schedule=2d", "--passes lift,split_embedding_comm"
    assert later in steps and step in steps
    assert steps[later] < steps[step]  # ranked by the simulated step: 2d ahead here
    order = [r.step_s for r in result.fitting]
    assert order == sorted(order)
