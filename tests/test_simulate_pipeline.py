"""commfx simulate on pipeline plans: the schedule replay, boundary compression, memory of
micro-batches in flight, and the prediction of the committed Optimus-CC run (measured
figures from its JSON; no timing here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commfx.plan import Plan
from commfx.simulate import load_cluster, simulate
from commfx.simulate.pipeline import StageCost, Transfer, _peak_memory, _replay

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = load_cluster("emulated")


def _costs(stages: int, forward: float, backward: float) -> list[StageCost]:
    return [StageCost(forward, backward, 0.0, 0.0, forward + backward, 0.0, {}) for _ in range(stages)]


def _transfers(stages: int, seconds: float) -> list[Transfer]:
    return [Transfer(seconds, seconds, seconds, 1.0, 1.0, 1.0) for _ in range(stages - 1)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,count", [(2, 2), (3, 4), (4, 8)])
def test_replay_with_free_transfers_gives_the_textbook_step(schedule, stages, count):
    """Equal stages, free transfers: both schedules take (M + S - 1)(F + B)."""
    replay = _replay(schedule, _costs(stages, 1.0, 2.0), _transfers(stages, 0.0), count)
    assert max(replay.ends) == pytest.approx((count + stages - 1) * 3.0)


def test_a_send_travels_once_the_receiver_posts_its_receive():
    """1F1B, 2 stages, 2 micro-batches: the last stage runs F0 B0 F1 B1, so the second
    activation waits for B0 to end on the receiver before it moves (rendezvous), even though
    the first stage had it ready long before."""
    replay = _replay("1f1b", _costs(2, 1.0, 2.0), _transfers(2, 0.5), 2)
    f0, b0 = (next(s for s in replay.spans[1] if s[0] == name) for name in ("F0", "B0"))
    assert f0[1] == pytest.approx(1.5)  # F0 of stage 0 (1.0), then the activation (0.5)
    starts = sorted(start for start, _ in replay.wire)
    assert b0[2] == pytest.approx(4.5) and any(start == pytest.approx(b0[2]) for start in starts)
    # stage 1: F1 from 5.0 (the activation, 4.5 + 0.5), B1 ends at 8.0; its gradient
    # reaches stage 0 at 8.5, whose B1 ends at 10.5
    assert max(replay.ends) == pytest.approx(10.5)


def _predict(passes: str, **topology):
    plan = Plan.from_cli(passes, world_size=2, pp=2, ranks_per_node=1, **topology)
    cluster = CLUSTER.with_layout(2, 1, "10mbit,0ms")
    return simulate("gpt-moe", plan, cluster, model_kwargs={"hidden_size": 64, "expert_hidden": 64, "vocab_size": 256})


def test_compress_pipeline_squeezes_the_critical_sends_only_and_shortens_a_slow_link_step():
    """At 10 Mbit/s the boundary dominates: the epilogue-only default compresses the one
    critical gradient send of 2 micro-batches, rank 2 everywhere both; forward bytes stay.
    The exposed communication is what transfers add to the schedule with free ones."""
    plain = _predict("lift,pipeline_split:microbatches=2")
    epilogue = _predict("lift,pipeline_split:microbatches=2,compress_pipeline:rank=2")
    everywhere = _predict("lift,pipeline_split:microbatches=2,compress_pipeline:rank=2;epilogue_only=false")
    sent = [p.result.boundary_bytes for p in (plain, epilogue, everywhere)]
    assert sent[0] > sent[1] > sent[2]
    assert plain.result.step_s > 1.1 * epilogue.result.step_s
    # off the critical path a compressed send saves no time (Optimus-CC's point): only its codec costs
    assert everywhere.result.step_s == pytest.approx(epilogue.result.step_s, rel=0.05)
    assert all(0.0 <= p.result.exposed_comm_s <= p.result.comm_s + 1e-12 < p.result.step_s for p in (plain, epilogue, everywhere))


def test_gpipe_holds_every_micro_batch_and_1f1b_the_depth():
    """Activations kept at once: GPipe all M on every stage, 1F1B min(S - s, M) on stage s."""
    costs = [StageCost(1.0, 2.0, 0.0, 0.0, 3.0, 10.0, {"parameters": 100.0}) for _ in range(3)]
    assert _peak_memory(costs, "gpipe", 3, 4)["activations"] == 40.0
    assert _peak_memory(costs, "1f1b", 3, 4)["activations"] == 30.0  # stage 0: 3 in flight
    assert _peak_memory(costs, "1f1b", 3, 2)["total"] == 120.0
    real = {schedule: _predict(f"lift,pipeline_split:microbatches=4;schedule={schedule}").result.memory for schedule in ("1f1b", "gpipe")}
    assert real["gpipe"]["activations"] > 1.5 * real["1f1b"]["activations"]


def test_predicts_the_committed_optimus_cc_run():
    """pp = 2 on 2 nodes x 1 rank at 100 Mbit/s, quiet machine: each commfx plan's step
    within 15% and its ratio to the default compression within 10% (issue 34's bounds)."""
    from commfx.simulate.validate import validate

    comparisons, skipped = validate(ROOT / "benchmarks" / "peers_optimus_cc_pipelining_quiet_100mbit_2x1.json")
    assert {c.label for c in comparisons} == {"plan", "uncompressed", "rank 16 everywhere"}
    assert skipped == ["baseline (peer:pipelining): a peer, not a commfx plan"]
    for c in comparisons:
        assert abs(c.step_error) <= 0.15, (c.label, c.predicted_s, c.measured_s)
        assert abs(c.ratio_error) <= 0.10, (c.label, c.predicted_ratio, c.measured_ratio)


def test_simulate_command_line_lays_out_a_pipeline_and_traces_each_stage(tmp_path, capsys):
    from commfx.cli.main import main

    out, trace = tmp_path / "sim.json", tmp_path / "trace.json"
    argv = ["simulate", "gpt-moe", "--passes", "lift,pipeline_split:microbatches=4,compress_pipeline", "--pp", "2", "--nodes", "2",
            "--ranks-per-node", "1", "--inter-node", "100mbit", "--model-arg", "hidden_size=64", "--json", str(out), "--trace", str(trace)]
    assert main(argv) == 0
    assert "pipeline boundaries: bytes per step" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["pipeline_boundary_bytes_per_step"] > 0 and record["exposed_comm_s"] < record["step_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}  # a process per stage
    actions = {e["args"]["node"] for e in events if e.get("ph") == "X" and e["pid"] == 1 and e["name"] == "stage 1"}
    assert actions == {f"{kind}{mb}" for kind in "FB" for mb in range(4)}
