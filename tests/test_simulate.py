"""commfx simulate: cluster files, the event simulation's scheduling rules, the command line,
and its predictions against the committed bench runs (no timing here: the measured figures
come from the JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from commfx.cli.main import main
from commfx.plan import Plan, PlanError
from commfx.simulate import load_cluster, presets
from commfx.simulate.engine import Simulation
from commfx.simulate.workload import Comm, Item, Workload

ROOT = Path(__file__).resolve().parent.parent
# What the emulated preset achieves on the committed Lina runs (issue 34 asks for 15% and 10%).
STEP_TOLERANCE, RATIO_TOLERANCE = 0.10, 0.10


def test_presets_load_and_emulated_takes_the_bench_layout():
    assert {"emulated", "h100", "a100"} <= set(presets())
    h100 = load_cluster("h100")
    assert h100.ranks_per_node == 8 and h100.inter_node.bandwidth == 50e9
    emulated = load_cluster("emulated").with_layout(4, 1, "200mbit,1ms")
    assert emulated.world_size == 4 and emulated.inter_node.bandwidth == 25e6 and emulated.inter_node.latency_s == 1e-3


def test_emulated_ranks_share_the_machines_cores():
    """4 ranks on a 2-core machine each get half a core: every op takes twice as long; a
    GPU cluster's ranks each have their own device."""
    shared = load_cluster("emulated").with_layout(2, 2, cores=2).device
    own = load_cluster("emulated").with_layout(2, 1, cores=2).device
    assert shared.slowdown == 2.0 and own.slowdown == 1.0
    assert shared.op_seconds(1e9, 0.0) == pytest.approx(2 * own.op_seconds(1e9, 0.0))
    assert load_cluster("a100").with_layout(4, cores=2).device.slowdown == 1.0


def test_bad_cluster_files_name_the_file_and_the_field(tmp_path):
    with pytest.raises(PlanError, match="unknown cluster 'h200'.*a100, emulated, h100"):
        load_cluster("h200")
    text = (ROOT / "src/commfx/clusters/h100.toml").read_text()
    missing = tmp_path / "mine.toml"
    missing.write_text(text.replace("memory_bandwidth = 3.35e12", ""))
    with pytest.raises(PlanError, match=r"mine.toml: field device.memory_bandwidth is missing"):
        load_cluster(str(missing))
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('all_reduce = "ring"', 'all_reduce = "butterfly"'))
    with pytest.raises(PlanError, match=r"bad.toml: field collectives.all_reduce must be one of ring, tree"):
        load_cluster(str(bad))


def _step(priority: bool, chunk: int):
    """A backward whose gradient all-reduce (8 chunks) is submitted just before an all-to-all."""
    cluster = load_cluster("emulated").with_layout(2, 1, "100mbit,0ms")
    plan = Plan.from_cli("lift", world_size=2, ranks_per_node=1)
    a2a = Comm(1, "all_to_all", "all_to_all", "ep", "a2a", "dispatch (bw)", 2_000_000)
    items = [
        Item("compute", "fw", "forward", label="mm", flops=1e9),
        Item("grads", "g", "backward", params=["w"]),
        Item("start", "a2a", "backward", comm=a2a),
        Item("wait", "a2a", "backward", comm_id=1),
        Item("compute", "bw", "backward", label="mm", flops=1e9),
        Item("compute", "step", "optimizer", label="optimizer step", nbytes=1e6),
    ]
    workload = Workload(items, {"w": (1 << 20, 4, "dp")}, 0.0, [])
    program = SimpleNamespace(runtime=SimpleNamespace(comm_schedule=SimpleNamespace(priority=priority, grad_chunk_bytes=chunk)))
    return Simulation(workload, program, plan, cluster).run()


def test_all_to_all_pre_empts_gradient_chunks_only_with_priority():
    """The runtime's lane rule: a chunk on the wire is not interrupted, but with priority
    (partition_a2a) no further gradient chunk starts while the all-to-all is queued or in
    flight; without (one unchunked bucket) it shares the link with the whole bucket."""
    with_priority, without = _step(True, 1 << 19), _step(False, 0)
    a2a = next(p for p in with_priority.history if p.kind == "all_to_all")
    assert a2a.t_done < 0.85 * next(p for p in without.history if p.kind == "all_to_all").t_done
    chunks = [p for p in with_priority.history if p.kind == "grad_all_reduce"]
    assert len(chunks) == 8 and sum(c.t_issue < a2a.t_done for c in chunks) == 1
    assert with_priority.step_s == pytest.approx(without.step_s, rel=0.05)  # the same bytes either way


def test_simulate_command_line_json_and_trace(tmp_path, capsys):
    out, trace = tmp_path / "sim.json", tmp_path / "trace.json"
    argv = ["simulate", "gpt-moe-tiny", "--passes", "lift,expert_parallel,partition_a2a:k=2", "--cluster", "h100", "--nodes", "2",
            "--ranks-per-node", "2", "--json", str(out), "--trace", str(trace)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "exposed communication" in printed and "peak memory per rank" in printed
    record = json.loads(out.read_text())
    assert record["world_size"] == 4 and record["step_s"] > 0
    assert record["compute_s"] <= record["step_s"] and record["exposed_comm_s"] <= record["comm_s"] + 1e-12
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("args", {}).get("chunk", "").endswith("dispatch 2/2") for e in events)
    assert main(["simulate", "gpt-moe-tiny", "--cluster", "nowhere.toml"]) == 2
    assert "cluster file nowhere.toml does not exist" in capsys.readouterr().out


def _validated(json_name: str, labels: list[str] | None = None):
    from commfx.simulate.validate import validate

    comparisons, _ = validate(ROOT / "benchmarks" / json_name, labels=labels)
    return {c.label: c for c in comparisons}


# The page's Lina runs are re-measured as the code changes, and this machine's compute drifts
# between runs by more than the preset's fixed rate follows (benchmarks/prediction_error.py
# reports every run's error). The tests below pin recorded runs of the same plans instead.
MIXTRAL_RUN = "log/2026-11-28-lina_mixtral_proportions_2x1_e88503c.json"
TOY_RUN = "log/2026-11-28-lina_gpt_moe_100mbit_2x1_k2.json"


def test_predicts_a_committed_run():
    """Naive expert parallelism on the Mixtral-proportioned model, 2 x 1 at the link sized from
    the measured machine: predicted against the median a recorded run measured. Its full
    Lina plan uses passes the simulator does not model, and validation says so."""
    from commfx.simulate.validate import validate

    (c,) = _validated(MIXTRAL_RUN, labels=["naive"]).values()
    assert abs(c.step_error) <= STEP_TOLERANCE, (c.predicted_s, c.measured_s)
    _, notes = validate(ROOT / "benchmarks" / MIXTRAL_RUN, labels=["plan"])
    assert any("microbatch_overlap, defer_grad_sync not modelled" in note for note in notes), notes


@pytest.mark.slow
@pytest.mark.parametrize("json_name, modelled", [(TOY_RUN, {"naive"}),
                                                  (MIXTRAL_RUN, {"naive"})])
def test_predicts_committed_runs_and_their_ratios(json_name, modelled):
    """Every commfx plan of the run the simulator models (naive expert parallelism: full Lina
    adds microbatch_overlap and defer_grad_sync, which it does not), and its ratio to the peer."""
    found = _validated(json_name)
    assert set(found) == modelled
    for c in found.values():
        assert abs(c.step_error) <= STEP_TOLERANCE, (c.label, c.predicted_s, c.measured_s)
        assert abs(c.ratio_error) <= RATIO_TOLERANCE, (c.label, c.predicted_ratio, c.measured_ratio)


@pytest.mark.slow
def test_readme_simulate_example_runs():
    import runpy

    runpy.run_path(str(ROOT / "examples" / "simulate_plan.py"), run_name="__main__")


def test_the_vocabulary_split_head_costs_what_the_dense_head_does():
    """split_embedding_comm's sharded LM head (commfx.vocab_parallel_loss) is a matmul of every
    rank's tokens against 1/P of the rows: as many FLOPs per rank as the dense head on this
    rank's tokens (it once counted as free, predicting the EmbRace run 79% short)."""
    from commfx.compiler.pipeline import compile_program
    from commfx.cost.flops import node_flops
    from commfx.models import NextTokenLoss, build_gpt_moe, shifted
    from commfx.verify import data_share, local_batch

    model, (ids,) = build_gpt_moe(vocab_size=2048, hidden_size=32, num_experts=4, expert_hidden=32, max_seq=32, batch=4, seq=17)
    plan = Plan.from_cli("lift,expert_parallel,split_embedding_comm:head=shard", world_size=2)
    local = local_batch(shifted(ids), *data_share(plan, 0))
    program = compile_program(NextTokenLoss(model), plan, local)
    heads = [n for n in program.gm.graph.nodes if "vocab_parallel_loss" in str(n.target)]
    tokens = local[0].numel()
    assert len(heads) == 1 and node_flops(heads[0]) == 2.0 * tokens * 32 * 2048


def test_a_sparse_embedding_table_exchanges_its_row_gradients_in_the_backward():
    """split_embedding_comm:strategy=sparse: the table's gradient goes as coalesced rows to
    every rank (exchange_row_grads, inside the backward), not in the dense all-reduce."""
    from commfx.compiler.pipeline import compile_program
    from commfx.models import build_gpt_moe
    from commfx.simulate.workload import build_workload

    model, (ids,) = build_gpt_moe(vocab_size=512, hidden_size=32, num_experts=4, expert_hidden=32, max_seq=16, batch=4, seq=16)
    plan = Plan.from_cli("lift,expert_parallel,split_embedding_comm:strategy=sparse", world_size=2)
    program = compile_program(model, plan, (ids[:2],))
    workload = build_workload(program, plan, program.tokens_per_rank)
    exchanges = [i.comm for i in workload.items if i.what == "start" and i.comm.tag == "embedding row grads"]
    assert len(exchanges) == 2 and {c.group for c in exchanges} == {"world"}  # token and position tables
    assert all(i.phase == "backward" for i in workload.items if i.what == "start" and i.comm.tag == "embedding row grads")
    tokens, hidden = 2 * 16, 32
    assert max(c.payload for c in exchanges) >= 2 * tokens * hidden * 4  # each rank's rows to both ranks
    tables = [name for name in workload.params if "embed" in name]
    assert tables and all(workload.params[name][2] is None for name in tables)  # not in the dense all-reduce
