"""Plan(activation_memory_budget=...) (issue 42, item 5): a budget outside (0, 1] is refused;
a low budget makes the forward save fewer bytes for the backward, recomputes no commfx op
(no extra collective) and keeps the loss and every gradient equal to the plain model in
float64; `commfx dump` shows the budget and what the forward saves."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from commfx.cli.main import main
from commfx.models import load_model
from commfx.plan import Plan, PlanError
from commfx.runtime.launcher import launch

sys.path.insert(0, str(Path(__file__).parent))
from remat_workers import next_token_loss  # noqa: E402

LOW = 0.1


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, math.nan, "0.5", True])
def test_a_budget_outside_0_1_is_refused_with_the_range(budget):
    plan = dataclasses.replace(Plan.from_cli("lift", world_size=1), activation_memory_budget=budget)
    with pytest.raises(PlanError, match=re.escape("activation_memory_budget must be a number in (0, 1] or None")):
        plan.validate()


def test_budgets_in_range_are_taken_and_the_command_line_refuses_zero(capsys):
    for budget in (None, 1, 0.25):
        dataclasses.replace(Plan.from_cli("lift", world_size=1), activation_memory_budget=budget).validate()
    with pytest.raises(SystemExit) as info:
        main(["dump", "gpt-moe-tiny", "--world-size", "1", "--activation-memory-budget", "0"])
    assert info.value.code == 2
    assert "--activation-memory-budget: must be a number in (0, 1], got 0" in " ".join(capsys.readouterr().err.split())


@pytest.mark.distributed
def test_a_low_budget_saves_fewer_bytes_and_keeps_the_loss_and_every_gradient():
    (results,) = launch("remat_workers:step_under_budgets", 1, {"passes": "lift,expert_parallel", "budgets": [None, LOW]}, timeout_s=300)
    plain, low = results
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64)
    loss = next_token_loss(model(ids), ids)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    for run in (plain, low):
        assert abs(run["loss"].item() - loss.item()) <= 1e-10
        assert set(run["grads"]) == set(reference)
        for name, grad in reference.items():
            assert (run["grads"][name] - grad).abs().max().item() <= 1e-10, name
    assert 0 < low["saved_bytes"] < plain["saved_bytes"], (low["saved_bytes"], plain["saved_bytes"])
    assert low["saved_tensors"] < plain["saved_tensors"]
    # commfx's ops (the all-to-alls among them) are saved, never recomputed: the backward calls the same ones
    assert low["backward_commfx_ops"] == plain["backward_commfx_ops"] and "commfx.all_to_all_start.default" in plain["backward_commfx_ops"]


def test_dump_shows_the_budget_and_what_the_forward_saves(capsys):
    saved = {}
    for budget in (None, LOW):
        argv = ["dump", "gpt-moe-tiny", "--world-size", "1", "--stage", "forward"] + (["--activation-memory-budget", str(budget)] if budget else [])
        assert main(argv) == 0
        header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("# activation memory budget:"))
        assert header.startswith(f"# activation memory budget: {budget:g}" if budget else "# activation memory budget: none")
        saved[budget] = int(re.search(r"saves \d+ activations, ([\d,]+) bytes", header).group(1).replace(",", ""))
    assert 0 < saved[LOW] < saved[None]
