"""Expert placement by affinity: routing statistics, the solver's choices and its load bound."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfx.runtime.placement import Placement, RoutingStats, balanced_placement, contiguous_placement, dispatch_rows, solve_placement, swap_search


def test_statistics_count_load_and_co_selection():
    stats = RoutingStats(4)
    stats.observe(torch.tensor([[0, 1], [1, 0], [2, 3], [3, 3]]))
    assert stats.load.tolist() == [2, 2, 1, 2]  # [3, 3] is one selection of expert 3
    assert stats.co_selected[0, 1] == stats.co_selected[1, 0] == 2
    assert stats.co_selected[2, 3] == 1 and stats.co_selected.diagonal().abs().sum() == 0
    assert stats.tokens == 4
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        stats.observe(torch.tensor([[0, 4]]))


def test_merge_and_state_dict_round_trip():
    a, b, both = RoutingStats(4), RoutingStats(4), RoutingStats(4)
    x, y = torch.tensor([[0, 2], [1, 3]]), torch.tensor([[0, 2], [2, 1]])
    a.observe(x)
    b.observe(y)
    both.observe(torch.cat([x, y]))
    a.merge(b)
    restored = RoutingStats(4)
    restored.load_state_dict(a.state_dict())
    for s in (a, restored):
        assert torch.equal(s.load, both.load) and torch.equal(s.co_selected, both.co_selected) and s.tokens == both.tokens
    with pytest.raises(ValueError, match="do not fit 8 experts"):
        RoutingStats(8).load_state_dict(a.state_dict())


def test_solver_puts_experts_chosen_together_on_one_rank():
    """Hand-checked: tokens pick (0, 3) or (1, 2); the contiguous layout splits both pairs."""
    stats = RoutingStats(4)
    routing = torch.tensor([[0, 3]] * 10 + [[1, 2]] * 8 + [[0, 1]] * 1)
    stats.observe(routing)
    placement = solve_placement(stats, ranks=2, epsilon=0.5)
    assert {frozenset(placement.experts_of(r)) for r in range(2)} == {frozenset({0, 3}), frozenset({1, 2})}
    # packed dispatch sends one row per (token, rank): 19 tokens, only (0, 1) still splits
    assert dispatch_rows(routing, placement) == 19 + 1
    assert dispatch_rows(routing, contiguous_placement(4, 2)) == 2 * 19 - 1


def test_solver_respects_the_load_bound_over_affinity():
    """Experts 0 and 1 are always chosen together but each carries half the load: sharing a
    rank would put all load on it, so under epsilon = 0.2 they stay apart."""
    stats = RoutingStats(4)
    stats.observe(torch.tensor([[0, 1]] * 12 + [[2, 3]] * 2))
    placement = solve_placement(stats, ranks=2, epsilon=0.2)
    assert placement.rank_of[0] != placement.rank_of[1]
    assert max(placement.loads(stats.load)) <= 1.2 * stats.load.sum() / 2
    loose = solve_placement(stats, ranks=2, epsilon=1.0)
    assert loose.rank_of[0] == loose.rank_of[1]


@settings(max_examples=40, deadline=None)
@given(
    experts_and_ranks=st.sampled_from([(4, 2), (8, 2), (8, 4), (6, 3), (12, 3), (16, 2)]),
    top_k=st.integers(1, 4),
    tokens=st.integers(1, 80),
    epsilon=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_solver_keeps_the_bound_and_never_loses_to_the_contiguous_layout(experts_and_ranks, top_k, tokens, epsilon, seed):
    experts, ranks = experts_and_ranks
    g = torch.Generator().manual_seed(seed)
    skew = torch.rand(experts, generator=g) ** 3 + 0.05
    routing = torch.multinomial(skew.expand(tokens, experts), top_k, generator=g)
    stats = RoutingStats(experts)
    stats.observe(routing)
    placement = solve_placement(stats, ranks, epsilon)
    assert sorted(placement.rank_of) == sorted(contiguous_placement(experts, ranks).rank_of)  # E/R experts per rank
    bound = (1 + epsilon) * float(stats.load.sum()) / ranks
    contiguous = contiguous_placement(experts, ranks)
    if max(contiguous.loads(stats.load)) <= bound:
        assert max(placement.loads(stats.load)) <= bound + 1e-9
        assert placement.colocated(stats.co_selected) >= contiguous.colocated(stats.co_selected) - 1e-9
        if top_k == 2:  # rows are exactly selections minus co-located pairs
            assert dispatch_rows(routing, placement) <= dispatch_rows(routing, contiguous)
    assert placement == solve_placement(stats, ranks, epsilon)  # deterministic: every rank decides the same
    for start in (contiguous, balanced_placement(stats.load, ranks)):  # the vectorised search makes the pairwise one's swaps
        assert swap_search(stats, ranks, epsilon, start, max_rounds=10_000) == swap_search_one_pair_at_a_time(stats, ranks, epsilon, start)


def test_clear_errors():
    with pytest.raises(ValueError, match="6 experts cannot be placed evenly on 4 ranks"):
        solve_placement(RoutingStats(6), ranks=4)
    with pytest.raises(ValueError, match="epsilon must be at least 0"):
        solve_placement(RoutingStats(4), ranks=2, epsilon=-0.1)


def swap_search_one_pair_at_a_time(stats: RoutingStats, ranks: int, epsilon: float, start: Placement) -> Placement:
    """The solver's local search written pair by pair, as its docstring states it: the
    specification the vectorised solver must match swap for swap."""
    load, co = stats.load, stats.co_selected
    bound = (1.0 + epsilon) * float(load.sum()) / ranks
    rank_of = list(start.rank_of)
    loads = [0.0] * ranks
    for e, r in enumerate(rank_of):
        loads[r] += float(load[e])

    def gain(a: int, b: int) -> float:
        ra, rb = rank_of[a], rank_of[b]
        return sum(float(co[a, e] - co[b, e]) if r == rb else float(co[b, e] - co[a, e]) if r == ra else 0.0
                   for e, r in enumerate(rank_of) if e not in (a, b))

    while True:
        best = None
        for a, b in itertools.combinations(range(len(rank_of)), 2):
            ra, rb = rank_of[a], rank_of[b]
            if ra == rb:
                continue
            delta = float(load[b] - load[a])
            new_a, new_b = loads[ra] + delta, loads[rb] - delta
            within = new_a <= bound + 1e-9 and new_b <= bound + 1e-9
            rebalances = max(loads[ra], loads[rb]) > bound + 1e-9 and max(new_a, new_b) < max(loads[ra], loads[rb]) - 1e-9
            g = gain(a, b)
            if (within or rebalances) and (g > 1e-9 or rebalances) and (best is None or (rebalances, g) > best[0]):
                best = ((rebalances, g), a, b, delta)
        if best is None:
            return Placement(tuple(rank_of), ranks)
        _, a, b, delta = best
        loads[rank_of[a]] += delta
        loads[rank_of[b]] -= delta
        rank_of[a], rank_of[b] = rank_of[b], rank_of[a]



def test_a_move_pays_back_in_the_steps_its_saved_rows_take_to_equal_its_bytes():
    """The re-placement's payback: 331 more co-located selections over a 2-step window of
    512-byte round trips save 84,736 B a step, so moving 2 experts of 2,064,384 B each
    repays in 48.7 steps; a move that sends nothing pays at once, one that saves nothing never."""
    from commfx.runtime.expert_placement import payback_steps

    assert payback_steps(331, 2, 512, 2 * 2_064_384) == pytest.approx(2 * 2_064_384 / (331 / 2 * 512))
    assert payback_steps(331, 1, 512, 2 * 2_064_384) == pytest.approx(payback_steps(331, 2, 512, 2 * 2_064_384) / 2)
    assert payback_steps(0, 2, 512, 0) == 0.0
    assert payback_steps(0, 2, 512, 1) == float("inf") and payback_steps(-5, 2, 512, 1) == float("inf")


def test_a_placement_is_adopted_when_it_pays_back_in_time_or_restores_balance():
    from commfx.runtime.expert_placement import _adopt
    from commfx.runtime.placement import SlotSolution

    balanced = SlotSolution(torch.arange(4), colocated=10.0, max_load=100.0, bound=110.0, within_bound=True)
    assert _adopt(20.0, 32.0, 100.0, balanced) and not _adopt(40.0, 32.0, 100.0, balanced)
    assert _adopt(1e9, float("inf"), 100.0, balanced) and _adopt(float("inf"), float("inf"), 100.0, balanced)  # inf: whatever the solver finds
    # the current placement is over the bound and the new one lowers it: adopted whatever the bytes
    assert _adopt(float("inf"), 0.0, 130.0, balanced) and not _adopt(float("inf"), 0.0, 100.0, balanced)
