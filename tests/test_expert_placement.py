"""Expert placement at runtime (pack_experts): per-layer routing statistics with cross-layer
transitions, placements through their state, and the slot solver the runtime re-places with
(`placement.solve_slots`) on hand-checked cases and under hypothesis: its load bound, never
worse than where it started, and as few experts moved as the chosen rank sets allow."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfx.runtime.expert_placement import Placements
from commfx.runtime.placement import Placement, RoutingStats, balanced_placement, slot_ranks, solve_slots

rank_of = slot_ranks


def stats_of(load: torch.Tensor, co: torch.Tensor) -> RoutingStats:
    stats = RoutingStats(load.numel())
    stats.load, stats.co_selected = load.double(), co.double()
    return stats


def solve(load, co, ranks, current, balance=0.1):
    return solve_slots(stats_of(load, co), ranks, current, balance)


def rank_loads(load: torch.Tensor, slot_of: torch.Tensor, ranks: int) -> torch.Tensor:
    return torch.zeros(ranks, dtype=torch.float64).index_add_(0, slot_ranks(slot_of, ranks), load.double())


def colocated(co: torch.Tensor, slot_of: torch.Tensor, ranks: int) -> float:
    return Placement(tuple(int(r) for r in slot_ranks(slot_of, ranks)), ranks).colocated(co.double())


def balanced(load: torch.Tensor, ranks: int) -> torch.Tensor:
    """balanced_placement as slots (a rank's experts in id order)."""
    rank = torch.tensor(balanced_placement(load.double(), ranks).rank_of)
    per_rank = load.numel() // ranks
    slot_of = torch.empty_like(rank)
    for r in range(ranks):
        members = (rank == r).nonzero().flatten()
        slot_of[members] = torch.arange(r * per_rank, r * per_rank + members.numel())
    return slot_of


def symmetric(experts: int, pairs: dict[tuple[int, int], int]) -> torch.Tensor:
    co = torch.zeros(experts, experts, dtype=torch.int64)
    for (i, j), n in pairs.items():
        co[i, j] = co[j, i] = n
    return co


def test_statistics_count_load_co_selection_and_transitions():
    stats = RoutingStats(3)
    stats.observe(torch.tensor([[0, 1], [1, 2], [0, 1]]), previous=None)
    stats.observe(torch.tensor([[2, 0]]), previous=torch.tensor([[3, 1]]))  # previous layer has 4 experts
    assert stats.load.tolist() == [3, 3, 2]
    assert stats.co_selected.tolist() == [[0, 2, 1], [2, 0, 1], [1, 1, 0]]
    # token 3: experts 3 and 1 in the previous layer, then 2 and 0 here
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[3, 2] = expected[3, 0] = expected[1, 2] = expected[1, 0] = 1
    assert torch.equal(stats.transitions, expected)


def test_placements_round_trip_through_their_state():
    placements = Placements()
    layer = placements.get("layers.0", 4, 2)
    layer.record(torch.tensor([[0, 3], [1, 2]]), None)
    layer.slot_of = torch.tensor([0, 2, 3, 1])
    restored = Placements()
    restored.load_state(placements.state())
    again = restored.layers["layers.0"]
    assert again.slot_of.tolist() == [0, 2, 3, 1] and again.ranks == 2
    assert torch.equal(again.stats.co_selected, layer.stats.co_selected) and torch.equal(again.stats.load, layer.stats.load)
    assert again.stats.tokens == 2


def test_co_selected_experts_end_up_together_moving_as_few_as_possible():
    # 0 with 3 and 1 with 2 are chosen together; today 0,1 share rank 0 and 2,3 rank 1.
    co = symmetric(4, {(0, 3): 10, (1, 2): 10, (0, 1): 1})
    solution = solve(torch.full((4,), 5), co, 2, torch.arange(4), balance=0.1)
    rank = rank_of(solution.slot_of, 2)
    assert rank[0] == rank[3] and rank[1] == rank[2] and rank[0] != rank[1]
    assert solution.colocated == 20 and solution.within_bound
    assert int((rank != rank_of(torch.arange(4), 2)).sum()) == 2  # one swap, not a reshuffle


def test_the_load_bound_keeps_two_hot_experts_apart():
    # 0 and 1 are hot and always chosen together; together they would load one rank 20 vs a mean of 11.
    load = torch.tensor([10, 10, 1, 1])
    co = symmetric(4, {(0, 1): 100})
    solution = solve(load, co, 2, torch.arange(4), balance=0.1)
    rank = rank_of(solution.slot_of, 2)
    assert rank[0] != rank[1]
    assert solution.max_load == 11 and solution.bound == (1.1 * 22 / 2) and solution.within_bound
    # With a loose bound they may share a rank.
    loose = solve(load, co, 2, torch.arange(4), balance=1.0)
    assert rank_of(loose.slot_of, 2)[0] == rank_of(loose.slot_of, 2)[1] and loose.colocated == 100


def test_an_optimal_placement_is_left_alone():
    co = symmetric(6, {(0, 1): 4, (2, 3): 4, (4, 5): 4})
    current = torch.arange(6)
    assert torch.equal(solve(torch.full((6,), 3), co, 3, current).slot_of, current)


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 4),
    balance=st.sampled_from([0.0, 0.1, 0.5]),
    seed=st.integers(0, 10_000),
)
def test_the_solver_keeps_its_load_bound_and_never_loses_co_location(ranks, per_rank, balance, seed):
    experts = ranks * per_rank
    generator = torch.Generator().manual_seed(seed)
    load = torch.randint(0, 50, (experts,), generator=generator)
    upper = torch.randint(0, 20, (experts, experts), generator=generator).triu(1)
    co = upper + upper.t()
    current = torch.randperm(experts, generator=generator)
    solution = solve(load, co, ranks, current, balance)
    assert sorted(solution.slot_of.tolist()) == list(range(experts))  # a placement: E/ranks experts per rank
    bound = (1 + balance) * float(load.sum()) / ranks
    start_max = min(float(rank_loads(load, current, ranks).max()), float(rank_loads(load, balanced(load, ranks), ranks).max()))
    assert solution.max_load == float(rank_loads(load, solution.slot_of, ranks).max())
    assert solution.max_load <= max(bound, start_max) + 1e-9
    if float(rank_loads(load, current, ranks).max()) <= bound:
        assert solution.within_bound
        assert solution.colocated >= colocated(co, current, ranks)
    assert solution.colocated == colocated(co, solution.slot_of, ranks)
