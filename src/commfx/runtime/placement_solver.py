"""Place experts on ranks by affinity (Lina's expert packing): experts often chosen by the
same token share a rank, so that token is sent there once instead of twice.

Given one layer's routing statistics (load[e]: assignments of expert e; co[i, j]: tokens
that chose both i and j) and `ranks` ranks of E/ranks experts each, find a placement that
maximises the co-located selections sum_{i<j on one rank} co[i, j] while every rank's
expert rows (the compute it does) stay within the load bound (1 + balance) * mean.

Exact placement is a graph partitioning problem (NP-hard); this is a deterministic local
search: start from the current placement if it meets the bound (else a longest-first
balanced one), then apply the best pairwise swap that adds co-located selections and keeps
the bound, until none does. Deterministic, so every rank given the same (all-reduced)
statistics decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Solution:
    slot_of: torch.Tensor  # [E] int64: expert -> slot (rank = slot // (E / ranks))
    colocated: float  # co-located selections of this placement
    max_load: float  # the largest rank's expert rows
    bound: float  # (1 + balance) * mean rows per rank
    within_bound: bool


def rank_of(slot_of: torch.Tensor, ranks: int) -> torch.Tensor:
    return slot_of // (slot_of.numel() // ranks)


def colocated(co: torch.Tensor, slot_of: torch.Tensor, ranks: int) -> float:
    """sum over pairs i<j on one rank of co[i, j] (co symmetric, zero diagonal)."""
    rank = rank_of(slot_of, ranks)
    same = rank.unsqueeze(0) == rank.unsqueeze(1)
    return float((co.double() * same).sum() / 2)


def rank_loads(load: torch.Tensor, slot_of: torch.Tensor, ranks: int) -> torch.Tensor:
    return torch.zeros(ranks, dtype=torch.float64).index_add_(0, rank_of(slot_of, ranks), load.double())


def balanced(load: torch.Tensor, ranks: int) -> torch.Tensor:
    """Longest-first: heaviest expert to the lightest rank with a free slot (ties: lower ids)."""
    experts = load.numel()
    per_rank = experts // ranks
    totals, filled = [0.0] * ranks, [0] * ranks
    slot_of = torch.empty(experts, dtype=torch.int64)
    for e in sorted(range(experts), key=lambda e: (-float(load[e]), e)):
        r = min((r for r in range(ranks) if filled[r] < per_rank), key=lambda r: (totals[r], r))
        slot_of[e] = r * per_rank + filled[r]
        totals[r] += float(load[e])
        filled[r] += 1
    return slot_of


def solve(load: torch.Tensor, co: torch.Tensor, ranks: int, current: torch.Tensor, balance: float = 0.1, max_swaps: int = 10_000) -> Solution:
    """The placement for one layer (see the module docstring)."""
    load, co = load.double().cpu(), co.double().cpu()
    co = (co + co.t()) / 2
    co.fill_diagonal_(0)
    experts = load.numel()
    bound = (1 + balance) * float(load.sum()) / ranks
    start = current.clone().cpu()
    if float(rank_loads(load, start, ranks).max()) > bound:
        candidate = balanced(load, ranks)
        if float(rank_loads(load, candidate, ranks).max()) < float(rank_loads(load, start, ranks).max()):
            start = candidate
    slot_of = start
    limit = max(bound, float(rank_loads(load, slot_of, ranks).max()))  # never worse than the start
    for _ in range(max_swaps):
        rank = rank_of(slot_of, ranks)
        onehot = torch.nn.functional.one_hot(rank, ranks).double()  # [E, P]
        affinity = co @ onehot  # affinity[e, r]: co-selections of e with the experts on r
        own = affinity.gather(1, rank.unsqueeze(1)).squeeze(1)
        # Swapping a (on p) and b (on q): a gains its affinity to q minus b, loses its own; likewise b.
        gain = affinity[:, rank].t() + affinity[:, rank] - own.unsqueeze(1) - own.unsqueeze(0) - 2 * co
        totals = onehot.t() @ load
        delta = load.unsqueeze(0) - load.unsqueeze(1)  # delta[a, b] = load[b] - load[a]: p's change
        p_after = totals[rank].unsqueeze(1) + delta
        q_after = totals[rank].unsqueeze(0) - delta
        allowed = (rank.unsqueeze(1) != rank.unsqueeze(0)) & (p_after <= limit + 1e-9) & (q_after <= limit + 1e-9)
        gain = torch.where(allowed, gain, torch.zeros_like(gain))
        best = int(torch.argmax(gain))
        if float(gain.view(-1)[best]) <= 1e-9:
            break
        a, b = divmod(best, experts)
        slot_of = slot_of.clone()
        slot_of[a], slot_of[b] = slot_of[b].clone(), slot_of[a].clone()
    slot_of = _canonical(slot_of, current, ranks)
    max_load = float(rank_loads(load, slot_of, ranks).max())
    return Solution(slot_of, colocated(co, slot_of, ranks), max_load, bound, max_load <= bound + 1e-9)


def _canonical(slot_of: torch.Tensor, current: torch.Tensor, ranks: int) -> torch.Tensor:
    """The same rank sets, with as few experts moved as possible: ranks' expert sets are
    matched to the current ranks greedily by overlap (heaviest overlap first), and an expert
    staying on its rank keeps its slot. Moving fewer experts moves fewer weights."""
    experts = slot_of.numel()
    per_rank = experts // ranks
    new_rank, old_rank = rank_of(slot_of, ranks), rank_of(current, ranks)
    overlap = torch.zeros(ranks, ranks, dtype=torch.int64)
    overlap.index_put_((new_rank, old_rank), torch.ones(experts, dtype=torch.int64), accumulate=True)
    assign: dict[int, int] = {}
    pairs = sorted(((-int(overlap[n, o]), n, o) for n in range(ranks) for o in range(ranks)))
    for _, n, o in pairs:
        if n not in assign and o not in assign.values():
            assign[n] = o
    out = torch.empty_like(slot_of)
    for n, o in assign.items():
        members = [e for e in range(experts) if int(new_rank[e]) == n]
        staying = [e for e in members if int(old_rank[e]) == o]
        free = sorted(set(range(o * per_rank, (o + 1) * per_rank)) - {int(current[e]) for e in staying})
        for e in staying:
            out[e] = current[e]
        for e, s in zip([e for e in members if e not in staying], free):
            out[e] = s
    return out
