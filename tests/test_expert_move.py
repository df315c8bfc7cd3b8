"""Moving re-placed experts (pack_experts): only the experts whose rank changes travel,
with their optimizer state, point to point; the result equals permuting the experts of
the single-process model, bit for bit, and the bytes are exactly the moved rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfx.runtime.expert_placement import plan_move


def apply_plans(stacks: list[torch.Tensor], old: torch.Tensor, new: torch.Tensor, ranks: int) -> tuple[list[torch.Tensor], int]:
    """Every rank's plan carried out in one process: rows sent to a peer arrive there in
    the order they were sent. Returns the new stacks and the rows that crossed ranks."""
    plans = [plan_move(old, new, ranks, r) for r in range(ranks)]
    out = [s.clone() for s in stacks]
    crossed = 0
    for r, plan in enumerate(plans):
        for new_row, old_row in plan.keep:
            out[r][new_row] = stacks[r][old_row]
        for peer, rows in plan.recv.items():
            sent = plans[peer].send[r]
            assert len(sent) == len(rows)
            out[r][list(rows)] = stacks[peer][list(sent)]
            crossed += len(rows)
    return out, crossed


@settings(max_examples=80, deadline=None)
@given(ranks=st.sampled_from([1, 2, 3, 4]), per_rank=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_move_plans_permute_the_experts_and_send_only_those_that_change_rank(ranks, per_rank, seed):
    experts = ranks * per_rank
    generator = torch.Generator().manual_seed(seed)
    old, new = torch.randperm(experts, generator=generator), torch.randperm(experts, generator=generator)
    model = torch.randn(experts, 3, generator=generator, dtype=torch.float64)  # expert e's weights: row e
    stacks = [torch.empty(per_rank, 3, dtype=torch.float64) for _ in range(ranks)]
    for e in range(experts):
        stacks[int(old[e]) // per_rank][int(old[e]) % per_rank] = model[e]
    out, crossed = apply_plans(stacks, old, new, ranks)
    for e in range(experts):
        assert torch.equal(out[int(new[e]) // per_rank][int(new[e]) % per_rank], model[e])
    assert crossed == int((old // per_rank != new // per_rank).sum())
    for r in range(ranks):
        plan = plan_move(old, old, ranks, r)
        assert plan.unchanged and not plan.send and not plan.recv


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_move_equals_permuting_the_single_process_experts_and_sends_only_moved_rows(world_size):
    """float64 AdamW state on every rank; after `move_experts` every parameter row and
    every exp_avg / exp_avg_sq row is the expert's own, bit for bit (step counters
    untouched); the ranks together sent moved experts x row bytes x (1 + 2 moments), in
    one message per peer; nothing when the placement is the same or only rows inside a
    rank change."""
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    ranks = launch("expert_move_workers:move_against_reference", world_size, timeout_s=240, collective_timeout_s=60)
    row_bytes, per_param = ranks[0]["row_bytes"], ranks[0]["state_tensors_per_param"]
    for case in range(3):
        label = ranks[0]["results"][case]["label"]
        moved = sum(ranks[0]["results"][case]["moved"].values())
        sent = sum(r["results"][case]["sent_bytes"] for r in ranks)
        calls = [r["results"][case]["calls"] for r in ranks]
        for r in ranks:
            assert r["results"][case]["unequal"] == [], (label, r["results"][case]["unequal"])
        assert sent == moved * row_bytes * (1 + per_param), (label, sent, moved)
        if label == "random":
            assert moved > 0, "the random placement moved experts (else this proves nothing)"
            assert all(c <= world_size - 1 for c in calls), calls  # one message per peer (one dtype)
        else:
            assert moved == 0 and sent == 0 and calls == [0] * world_size, (label, calls)
    assert ranks[0]["results"][2]["changed_rows"], "the within-rank case permuted rows (else it proves nothing)"


def test_commfx_bench_re_places_inside_the_timed_step_and_counts_the_moved_bytes(tmp_path):
    """pack_experts:replace_every=2 with 2 steps a round, no warm-up: every round ends with
    a re-placement inside its timed span (the first one moves experts), so the statistics' all-reduce and the
    moved experts are in the step's counted bytes: expert_move bytes per step = moved
    experts x row bytes x (1 + AdamW's 2 moments) over the measured rounds' steps."""
    import json
    import os
    import subprocess

    from commfx.models import load_model

    root = Path(__file__).resolve().parents[1]
    driver = ("import argparse, sys\nfrom commfx.cli.bench import add_parser\np = argparse.ArgumentParser(prog='commfx')\n"
              "add_parser(p.add_subparsers(dest='command', required=True))\na = p.parse_args(sys.argv[1:])\nsys.exit(a.func(a))\n")
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-c", driver, "bench", "gpt-moe-tiny", "--passes", "lift,expert_parallel,pack_experts:replace_every=2;balance=0.0",
            "--nodes", "2", "--ranks-per-node", "1", "--no-emulation", "--steps", "2", "--warmup", "0", "--steps-per-round", "2",
            "--timeout", "150", "--json", str(out)]
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(root / "src")}
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=200)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    plan = json.loads(out.read_text())["plans"][0]
    model = load_model("gpt-moe-tiny")[0]
    layers, experts = model.config.num_layers, model.config.num_experts
    row_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n) // (layers * experts)
    lines = plan["expert_placement_decisions"]
    steps = [int(line.split()[2].rstrip(":")) for line in lines]
    assert steps == sorted([2, 4] * layers), lines  # after each round's 2nd step
    moved = sum(int(line.split(" moved ")[1].split()[0]) for line in lines)
    assert moved > 0, lines
    counted = plan["bytes_per_step"]
    assert counted["placement_stats"]["calls"] == layers * 2 / 2  # per layer and round, each rank: inside the span
    measured_steps = 2 * 2
    move_bytes = counted.get("expert_move", {}).get("inter_node_bytes", 0)
    assert move_bytes * measured_steps == moved * row_bytes * 3, (lines, counted)
