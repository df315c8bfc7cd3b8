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
