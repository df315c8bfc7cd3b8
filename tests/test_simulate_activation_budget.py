"""The simulator under Plan(activation_memory_budget=...) (issue 42, item 5): peak memory
falls and the step grows as the budget falls (the backward recomputes what the forward
dropped), and `commfx plan` recomputes to fit a device whose memory the plain plan's
activations overflow."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from commfx.cli.main import main
from commfx.plan import Plan
from commfx.simulate import Captures, load_cluster, simulate

LOW = 0.1


def test_simulated_memory_falls_and_the_step_grows_as_the_budget_falls():
    cluster = load_cluster("a100").with_layout(1, 1)
    captures = Captures()
    results = {}
    for budget in (None, 1.0, 0.5, LOW):
        plan = dataclasses.replace(Plan.from_cli("lift", world_size=1), activation_memory_budget=budget)
        results[budget] = simulate("gpt-moe", plan, cluster, captures=captures).result
    plain = results[None]
    assert results[1.0].memory == plain.memory and results[1.0].step_s == pytest.approx(plain.step_s)
    activations = [results[b].memory["activations"] for b in (None, 0.5, LOW)]
    assert activations[0] > activations[1] > activations[2] > 0
    assert activations[1] <= 0.5 * activations[0] and activations[2] <= LOW * activations[0]
    assert plain.compute_s < results[0.5].compute_s < results[LOW].compute_s  # the backward recomputes the dropped ops
    for budget in (0.5, LOW):  # parameters, gradients and optimizer state do not move
        assert results[budget].memory["total"] - results[budget].memory["activations"] == plain.memory["total"] - plain.memory["activations"]


def test_plan_recomputes_to_fit_a_device_the_plain_plan_overflows(tmp_path, capsys):
    """A cluster file whose device holds the plain plan's state and half its activations:
    `commfx plan` (memory limit auto: the device's) picks a budget below 1 and its predicted
    peak fits."""
    plain = simulate("gpt-moe", Plan.from_cli("lift", world_size=1), load_cluster("a100").with_layout(1, 1)).result.memory
    device_bytes = plain["total"] - 0.5 * plain["activations"]
    text = Path(load_cluster("a100").source).read_text()
    text = re.sub(r"memory_bytes = \S+", f"memory_bytes = {device_bytes:.0f}", text)
    text = re.sub(r"flops = \{[^}]*\}", "flops = { fp32 = 19.5e12 }", text)  # no bf16 rate: precision cannot make room
    cluster_file = tmp_path / "small.toml"
    cluster_file.write_text(text)
    emitted = tmp_path / "plan.txt"
    assert main(["plan", "gpt-moe", "--cluster", str(cluster_file), "--world", "1", "--top", "10", "--emit", str(emitted)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    chosen = re.search(r"chosen: commfx run gpt-moe (.*?--activation-memory-budget (\S+))", out)
    assert chosen, out
    budget = float(chosen.group(2))
    assert 0 < budget < 1
    assert "over the memory limit" in out and "--passes lift at" in out  # the plain plan did not fit
    passes = emitted.read_text().strip()
    cluster = load_cluster(str(cluster_file)).with_layout(1, 1)
    plan = dataclasses.replace(Plan.from_cli(passes, world_size=1), activation_memory_budget=budget)
    assert simulate("gpt-moe", plan, cluster).result.memory["total"] <= device_bytes
    # Given candidates of which none fits are tried with recomputation too.
    assert main(["plan", "gpt-moe", "--cluster", str(cluster_file), "--world", "1", "--candidate", "lift"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"chosen: commfx run gpt-moe --passes lift --activation-memory-budget 0\.\d+", out), out


def test_simulate_takes_the_budget_on_the_command_line(tmp_path):
    records = {}
    for budget in (None, LOW):
        out = tmp_path / f"{budget}.json"
        argv = ["simulate", "gpt-moe", "--passes", "lift", "--cluster", "a100", "--nodes", "1", "--ranks-per-node", "1", "--json", str(out)]
        assert main(argv + (["--activation-memory-budget", str(budget)] if budget else [])) == 0
        records[budget] = json.loads(out.read_text())
    assert records[None]["activation_memory_budget"] is None and records[LOW]["activation_memory_budget"] == LOW
    plain, low = (records[b]["peak_memory_bytes_per_rank"]["activations"] for b in (None, LOW))
    assert 0 < low <= LOW * plain
    assert records[LOW]["step_s"] > records[None]["step_s"]
    assert any(note.startswith(f"activation memory budget {LOW:g}: the forward keeps") for note in records[LOW]["notes"])
