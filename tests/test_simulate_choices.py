"""The simulator compiles what would run: with the cost models' figures a bench run compiled
with, it makes the run's automatic choices (partition_a2a k=auto), and `--validate` fails
when the two differ. Runs a preset was fitted to are marked in-sample."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from commfx.bench.worker import _PlanRunner
from commfx.compiler.capture import tokens_of
from commfx.compiler.pipeline import compile_program
from commfx.models import load_model
from commfx.plan import Plan
from commfx.runtime.machine_probe import MachineFigures, measured_topology
from commfx.simulate import load_cluster
from commfx.simulate.validate import ChoiceMismatch, validate
from commfx.verify import data_share, local_batch

ROOT = Path(__file__).resolve().parent.parent
MODEL, PASSES, LINK = "gpt-moe-tiny", "lift,expert_parallel,partition_a2a", "100mbit,0ms"
# Two machines the probe could find: a slow link with cheap calls pipelines the region in many
# chunks; expensive calls on a fast link send it at once.
SLOW_LINK = MachineFigures(flops_per_s=1e8, collective_s=1e-7, link_bytes_per_s=1e5, spans_nodes=True)
EXPENSIVE_CALLS = MachineFigures(flops_per_s=1e9, collective_s=1e-2, link_bytes_per_s=1e12, spans_nodes=True)


def _bench_plan() -> Plan:
    """The plan as `commfx bench --nodes 2 --ranks-per-node 1 --inter-node 100mbit` builds it."""
    return Plan.from_cli(PASSES, world_size=2, ranks_per_node=1, inter_node_bandwidth=100e6 / 8, inter_node_latency_s=0.0)


def _ranks_compile(measured: MachineFigures) -> dict:
    """What a bench rank records for the plan: compiled as `commfx.distribute` compiles it
    after the probe measured `measured`, read by the bench worker's own `compiled_with`."""
    plan = _bench_plan()
    plan = dataclasses.replace(plan, machine="measure", topology=measured_topology(plan.topology, measured))
    model, inputs = load_model(MODEL)
    local = local_batch(inputs, *data_share(plan, 0))
    program = compile_program(model, plan, local, tokens_per_rank=tokens_of(local))
    return _PlanRunner.compiled_with(SimpleNamespace(dm=SimpleNamespace(plan=plan, program=program)))


def _bench_json(tmp_path: Path, name: str, compiled: dict | None, notes: list[str] | None = None) -> Path:
    """A `commfx bench --json` file of one plan on 2 x 1 at 100 Mbit/s."""
    entry = {"label": "plan", "passes": PASSES, "layout": {"pp": 1, "tp": 1, "ep": 2, "precision": "fp32"},
             "wall": {"median_s": 0.05}, "compute_only": {"median_s": 0.02}}
    if compiled is not None:
        entry["compiled_with"] = compiled
    if notes is not None:
        entry["choices"] = notes
    record = {"model": MODEL, "model_kwargs": {}, "nodes": 2, "ranks_per_node": 1, "inter_node_link": LINK,
              "machine": {"cpus": 2}, "plans": [entry]}
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def _cluster(tmp_path: Path, fitted_to: list[str] = (), collective_s: float = 0.5e-3) -> Path:
    text = (ROOT / "src/commfx/clusters/emulated.toml").read_text()
    text = text.replace("overhead_s = 0.5e-3", f"overhead_s = {collective_s}")
    text = text[: text.index("fitted_to = [")] + f"fitted_to = {json.dumps(list(fitted_to))}\n" + text[text.index("\n[device]"):]
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_the_probes_note_reads_back_as_its_figures():
    """To the note's rounding (older bench runs kept only the note)."""
    for figures in (MachineFigures(93.2e9, 0.53e-3, 1054e6 / 8, True), MachineFigures(68.5e9, 0.44e-3, 54e6 / 8, True), MachineFigures(17.2e9, 0.0, float("inf"), False)):
        back = MachineFigures.parse(figures.describe())
        assert back.spans_nodes == figures.spans_nodes and back.link_bytes_per_s == pytest.approx(figures.link_bytes_per_s, rel=1e-2)
        assert back.flops_per_s == pytest.approx(figures.flops_per_s, rel=1e-2)
        assert back.collective_s == pytest.approx(figures.collective_s, abs=1e-5)
    assert MachineFigures.parse("partition_a2a: k=8 chunks") is None


@pytest.mark.parametrize("measured", [SLOW_LINK, EXPENSIVE_CALLS], ids=["slow-link", "expensive-calls"])
def test_simulate_with_the_runs_figures_chooses_the_ranks_k(tmp_path, measured, capsys):
    """`commfx simulate --machine-from BENCH_JSON` compiles with the figures the bench's ranks
    compiled with, and so picks the k they picked."""
    from commfx.cli.main import main

    ranks = _ranks_compile(measured)
    assert ranks["machine"] == "measure" and ranks["figures"]["flops_per_s"] == measured.flops_per_s
    run = _bench_json(tmp_path, "run.json", ranks)
    out = tmp_path / "sim.json"
    argv = ["simulate", MODEL, "--passes", PASSES, "--cluster", "emulated", "--nodes", "2", "--ranks-per-node", "1",
            "--inter-node", "100mbit", "--machine-from", str(run), "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().out
    simulated = json.loads(out.read_text())
    assert simulated["automatic_choices"]["partition_a2a:k"] == ranks["choices"]["partition_a2a:k"]
    assert simulated["automatic_choices"] == ranks["choices"]
    assert simulated["cost_model_figures"] == pytest.approx(ranks["figures"])


def test_the_two_machines_choose_differently():
    """So the test above can fail: figures the simulator ignored would give one k for both."""
    assert _ranks_compile(SLOW_LINK)["choices"]["partition_a2a:k"] == "8"
    assert _ranks_compile(EXPENSIVE_CALLS)["choices"]["partition_a2a:k"] == "1"


def test_machine_from_refuses_another_clusters_run(tmp_path, capsys):
    from commfx.cli.main import main

    run = _bench_json(tmp_path, "run.json", _ranks_compile(SLOW_LINK))
    argv = ["simulate", MODEL, "--passes", PASSES, "--nodes", "2", "--ranks-per-node", "1", "--inter-node", "1gbit", "--machine-from", str(run)]
    assert main(argv) == 2
    assert "its figures are another cluster's" in capsys.readouterr().out


def test_validate_compiles_with_the_runs_figures_and_agrees(tmp_path):
    run = _bench_json(tmp_path, "run.json", _ranks_compile(SLOW_LINK))
    (c,) = validate(run, load_cluster(str(_cluster(tmp_path))))[0]
    assert c.choices["partition_a2a:k"] == "8" and not c.unchecked and c.figures == "recorded" and not c.fitted


def test_validate_fails_naming_the_option_both_values_and_the_figures(tmp_path, capsys):
    """The run recorded k=8 but not its figures; the cluster's expensive collectives make the
    simulator choose k=1: the prediction would be of another program."""
    from commfx.cli.main import main

    ranks = _ranks_compile(SLOW_LINK)
    run = _bench_json(tmp_path, "run.json", None, notes=[f"partition_a2a: k={ranks['choices']['partition_a2a:k']} chunks per all-to-all "
                                                         "in 1 MoE region(s) (k=auto: the cost model's choice from the topology's figures)"])
    cluster = _cluster(tmp_path, collective_s=1.0)
    with pytest.raises(ChoiceMismatch) as raised:
        validate(run, load_cluster(str(cluster)))
    message = str(raised.value)
    assert "partition_a2a:k: the simulator compiled 1, the run's ranks compiled 8" in message
    assert "1000.00 ms per collective" in message and "did not record the figures" in message
    skipped = validate(run, load_cluster(str(cluster)), on_mismatch="skip")
    assert skipped[0] == [] and "partition_a2a:k" in skipped[1][0]
    assert main(["simulate", MODEL, "--cluster", str(cluster), "--validate", str(run)]) == 1
    assert "automatic choices differ: partition_a2a:k" in capsys.readouterr().out


def test_validate_with_the_same_figures_blames_the_compile(tmp_path):
    """Recorded figures that chose k=8 on the ranks, and a recorded k=1 (as if the ranks'
    compile had differed from the simulator's in something else)."""
    ranks = _ranks_compile(SLOW_LINK)
    ranks["choices"]["partition_a2a:k"] = "1"
    run = _bench_json(tmp_path, "run.json", ranks)
    with pytest.raises(ChoiceMismatch, match="Both chose with the same figures"):
        validate(run, load_cluster(str(_cluster(tmp_path))))


def test_a_run_the_cluster_was_fitted_to_is_marked_in_sample(tmp_path):
    run = _bench_json(tmp_path, "fitted_run.json", _ranks_compile(SLOW_LINK))
    (c,) = validate(run, load_cluster(str(_cluster(tmp_path, fitted_to=["fitted_run.json"]))))[0]
    assert c.fitted


def test_the_emulated_presets_fitting_runs_are_committed_bench_runs():
    fitted = load_cluster("emulated").fitted_to
    assert fitted
    for name in fitted:
        record = json.loads((ROOT / "benchmarks" / name).read_text())
        assert record["plans"] and record["inter_node_link"], name
    assert load_cluster("h100").fitted_to == () and load_cluster("a100").fitted_to == ()
