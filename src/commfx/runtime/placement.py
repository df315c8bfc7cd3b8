"""Expert placement by affinity (Lina, ExFlow): which experts share a rank.

With `pack_experts` a token crosses to a rank once however many of its experts live
there, so the rows on the wire are the unique (token, rank) pairs. Experts that are often
chosen by the same token should therefore share a rank. `RoutingStats` accumulates what a
placement needs (per expert load, and how often two experts serve the same token) as
runtime state that is summed over ranks and saved with `state_dict`; `solve_placement`
assigns experts to ranks to maximise co-located selections while keeping every rank's
load under (1 + epsilon) x the mean; `dispatch_rows` counts the rows a placement costs.
`solve_slots` is the same solver in the runtime's terms (slot = rank * E/R + local id),
keeping as many experts in their current slot as it can, since every moved expert moves
its weights and optimizer state (runtime/expert_placement.py).

Everything here is deterministic (ties broken by index), so ranks that hold the same
all-reduced statistics choose the same placement without talking to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "RoutingStats",
    "Placement",
    "SlotSolution",
    "balanced_placement",
    "contiguous_placement",
    "dispatch_rows",
    "slot_ranks",
    "solve_placement",
    "solve_slots",
    "swap_search",
]


class RoutingStats:
    """Counts of one MoE layer's routing: `load[e]` token-expert selections of expert e,
    `co_selected[i, j]` tokens that chose both i and j (symmetric, zero diagonal), and
    `transitions[i, j]` tokens that chose expert i in the previous MoE layer and j here
    (the cross-layer pattern Lina and ExFlow exploit; [previous layer's experts, E])."""

    def __init__(self, num_experts: int):
        if num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {num_experts}")
        self.num_experts = num_experts
        self.load = torch.zeros(num_experts, dtype=torch.float64)
        self.co_selected = torch.zeros(num_experts, num_experts, dtype=torch.float64)
        self.transitions = torch.zeros(0, num_experts, dtype=torch.float64)
        self.tokens = 0

    def observe(self, expert_ids: torch.Tensor, previous: torch.Tensor | None = None) -> None:
        """Add one batch of routing decisions: `expert_ids` is [tokens, k] (a router's top-k);
        `previous`, the same tokens' top-k in the previous MoE layer, if known."""
        ids = expert_ids.detach().reshape(-1, expert_ids.shape[-1]).long().cpu()
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts}); got {ids.min().item()}..{ids.max().item()}")
        chosen = torch.zeros(ids.shape[0], self.num_experts, dtype=torch.float64)
        chosen.scatter_(1, ids, 1.0)  # a token that picks an expert twice counts once
        self.load += chosen.sum(0)
        pairs = chosen.T @ chosen
        pairs.fill_diagonal_(0.0)
        self.co_selected += pairs
        self.tokens += ids.shape[0]
        if previous is not None and previous.numel() and previous.reshape(-1, previous.shape[-1]).shape[0] == ids.shape[0]:
            prev = previous.detach().reshape(ids.shape[0], -1).long().cpu()
            before = torch.zeros(ids.shape[0], max(int(prev.max()) + 1, self.transitions.shape[0]), dtype=torch.float64)
            before.scatter_(1, prev, 1.0)
            self._grow_transitions(before.shape[1])
            self.transitions += before.T @ chosen

    def _grow_transitions(self, rows: int) -> None:
        if rows > self.transitions.shape[0]:
            grown = torch.zeros(rows, self.num_experts, dtype=torch.float64)
            grown[: self.transitions.shape[0]] = self.transitions
            self.transitions = grown

    def merge(self, other: "RoutingStats") -> None:
        """Add another rank's (or step's) counts: what an all-reduce of the state does."""
        if other.num_experts != self.num_experts:
            raise ValueError(f"cannot merge statistics of {other.num_experts} experts into {self.num_experts}")
        self.load += other.load
        self.co_selected += other.co_selected
        self._grow_transitions(other.transitions.shape[0])
        self.transitions[: other.transitions.shape[0]] += other.transitions
        self.tokens += other.tokens

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "load": self.load.clone(),
            "co_selected": self.co_selected.clone(),
            "transitions": self.transitions.clone(),
            "tokens": torch.tensor(self.tokens),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load, co = state["load"], state["co_selected"]
        if load.shape != (self.num_experts,) or co.shape != (self.num_experts, self.num_experts):
            raise ValueError(f"routing statistics of shape {tuple(load.shape)} do not fit {self.num_experts} experts")
        self.load = load.to(torch.float64).clone()
        self.co_selected = co.to(torch.float64).clone()
        self.transitions = state.get("transitions", torch.zeros(0, self.num_experts)).to(torch.float64).clone()
        self.tokens = int(state["tokens"])


@dataclass(frozen=True)
class Placement:
    """`rank_of[e]`: the rank expert e lives on; every rank holds the same number of experts."""

    rank_of: tuple[int, ...]
    ranks: int

    def experts_of(self, rank: int) -> list[int]:
        return [e for e, r in enumerate(self.rank_of) if r == rank]

    def loads(self, load: torch.Tensor) -> list[float]:
        load = load.to(torch.float64)
        return load.new_zeros(self.ranks).index_add_(0, torch.tensor(self.rank_of), load).tolist()

    def colocated(self, co_selected: torch.Tensor) -> float:
        """Selections that share a rank: sum of co_selected[i, j] over pairs i < j on one rank."""
        rank_of = torch.tensor(self.rank_of)
        same = (rank_of[:, None] == rank_of[None, :]).triu(1)
        return float(co_selected.to(torch.float64)[same].sum())


def contiguous_placement(num_experts: int, ranks: int) -> Placement:
    """expert_parallel's layout: rank r holds experts [r E/R, (r+1) E/R)."""
    _check_divisible(num_experts, ranks)
    per_rank = num_experts // ranks
    return Placement(tuple(e // per_rank for e in range(num_experts)), ranks)


def dispatch_rows(expert_ids: torch.Tensor, placement: Placement) -> int:
    """Rows packed dispatch sends for these routing decisions: unique (token, rank) pairs."""
    rank_of = torch.tensor(placement.rank_of)
    ranks = rank_of[expert_ids.reshape(-1, expert_ids.shape[-1]).long()]
    hit = torch.zeros(ranks.shape[0], placement.ranks, dtype=torch.bool)
    hit.scatter_(1, ranks, True)
    return int(hit.sum())


def solve_placement(stats: RoutingStats, ranks: int, epsilon: float = 0.1, max_rounds: int = 50, start: Placement | None = None) -> Placement:
    """Experts to ranks, E/R each, maximising co-located selections with every rank's load
    at most (1 + epsilon) x the mean where that is reachable.

    Start from the best of expert_parallel's contiguous layout, a longest-processing-time
    assignment and `start` (the current placement, if given): the most co-located one under
    the bound, or else the best balanced one; then take the best improving swap of two experts on
    different ranks until none is left (a Kernighan-Lin style local search). A swap is
    allowed if it keeps both ranks under the bound, or, while the start is above the bound,
    if it lowers the larger of the two loads; so the result is never less balanced than the
    start and meets the bound whenever the start does.
    """
    if epsilon < 0:
        raise ValueError(f"epsilon must be at least 0, got {epsilon}")
    num_experts = stats.num_experts
    _check_divisible(num_experts, ranks)
    load, co = stats.load, stats.co_selected
    bound = (1.0 + epsilon) * float(load.sum()) / ranks
    candidates = [contiguous_placement(num_experts, ranks), balanced_placement(load, ranks)] + ([start] if start is not None else [])

    def preference(p: Placement) -> tuple[bool, float, float]:
        over = max(p.loads(load)) > bound + 1e-9
        return (over, max(p.loads(load)) if over else 0.0, -p.colocated(co))

    return swap_search(stats, ranks, epsilon, min(candidates, key=preference), max_rounds)


def swap_search(stats: RoutingStats, ranks: int, epsilon: float, start: Placement, max_rounds: int) -> Placement:
    """`solve_placement`'s local search from `start`: the best allowed swap, until none improves.
    Every pair's gain is computed at once from `beside` (each expert's co-selections per rank),
    which a swap updates in two columns, so a round costs O(E^2) tensor work, not O(E^3) Python."""
    num_experts = stats.num_experts
    load, co = stats.load, stats.co_selected
    bound = (1.0 + epsilon) * float(load.sum()) / ranks
    rank_of = torch.tensor(start.rank_of)
    members = torch.zeros(num_experts, ranks, dtype=torch.float64)
    members[torch.arange(num_experts), rank_of] = 1.0
    loads = load @ members  # per rank
    beside = co @ members  # beside[e, r]: co-selections of e with the experts on rank r (co's diagonal is 0)
    upper = torch.ones(num_experts, num_experts, dtype=torch.bool).triu(1)  # each pair (a < b) once
    delta = load[None, :] - load[:, None]  # delta[a, b]: load that moves onto a's rank if a and b trade

    for _ in range(max_rounds):
        # gain[a, b]: change of co-located selections if a and b trade ranks; all pairs at once
        toward = beside[:, rank_of]  # toward[a, b] = beside[a, rank of b]
        own = beside.gather(1, rank_of[:, None])
        gain = toward - own + toward.T - own.T - 2.0 * co
        load_a, load_b = loads[rank_of][:, None], loads[rank_of][None, :]
        new_a, new_b = load_a + delta, load_b - delta
        larger = torch.maximum(load_a, load_b)
        within = (new_a <= bound + 1e-9) & (new_b <= bound + 1e-9)
        rebalances = (larger > bound + 1e-9) & (torch.maximum(new_a, new_b) < larger - 1e-9)
        allowed = upper & (rank_of[:, None] != rank_of[None, :]) & (within | rebalances) & ((gain > 1e-9) | rebalances)
        if not bool(allowed.any()):
            break
        if bool((allowed & rebalances).any()):  # rebalancing first, then the largest gain; ties: the first pair
            allowed &= rebalances
        pick = int(torch.where(allowed, gain, float("-inf")).reshape(-1).argmax())
        a, b = divmod(pick, num_experts)
        ra, rb = int(rank_of[a]), int(rank_of[b])
        loads[ra] += delta[a, b]
        loads[rb] -= delta[a, b]
        beside[:, ra] += co[:, b] - co[:, a]
        beside[:, rb] += co[:, a] - co[:, b]
        rank_of[a], rank_of[b] = rb, ra
    return Placement(tuple(int(r) for r in rank_of), ranks)


def balanced_placement(load: torch.Tensor, ranks: int) -> Placement:
    """Balance alone (no affinity): longest processing time first, E/R experts per rank,
    the heaviest expert to the lightest rank with room."""
    num_experts = load.numel()
    per_rank = num_experts // ranks
    rank_of = [0] * num_experts
    totals, counts = [0.0] * ranks, [0] * ranks
    for e in sorted(range(num_experts), key=lambda e: (-float(load[e]), e)):
        r = min((r for r in range(ranks) if counts[r] < per_rank), key=lambda r: (totals[r], r))
        rank_of[e] = r
        totals[r] += float(load[e])
        counts[r] += 1
    return Placement(tuple(rank_of), ranks)


@dataclass(frozen=True)
class SlotSolution:
    """`solve_slots`' answer: slot_of[e] = rank * (E / R) + local id, and how good it is."""

    slot_of: torch.Tensor  # [E] int64
    colocated: float  # co-located selections of this placement
    max_load: float  # the largest rank's selections
    bound: float  # (1 + epsilon) * mean selections per rank
    within_bound: bool


def slot_ranks(slot_of: torch.Tensor, ranks: int) -> torch.Tensor:
    """The rank of each expert of a slot layout."""
    return slot_of // (slot_of.numel() // ranks)


def solve_slots(stats: RoutingStats, ranks: int, current: torch.Tensor, epsilon: float = 0.1) -> SlotSolution:
    """`solve_placement` from the current slot layout, returned as slots: each new rank set
    is matched to the current rank it overlaps most (heaviest overlap first) and an expert
    that stays on its rank keeps its slot, so as few experts (weights, optimizer state) move
    as the chosen rank sets allow."""
    current = current.cpu().long()
    start = Placement(tuple(int(r) for r in slot_ranks(current, ranks)), ranks)
    placement = solve_placement(stats, ranks, epsilon, max_rounds=max(50, stats.num_experts**2), start=start)
    slot_of = _keep_slots(torch.tensor(placement.rank_of), current, ranks)
    kept = Placement(tuple(int(r) for r in slot_ranks(slot_of, ranks)), ranks)
    max_load = max(kept.loads(stats.load))
    bound = (1.0 + epsilon) * float(stats.load.sum()) / ranks
    return SlotSolution(slot_of, kept.colocated(stats.co_selected), max_load, bound, max_load <= bound + 1e-9)


def _keep_slots(new_rank: torch.Tensor, current: torch.Tensor, ranks: int) -> torch.Tensor:
    experts = current.numel()
    per_rank = experts // ranks
    old_rank = slot_ranks(current, ranks)
    overlap = torch.zeros(ranks, ranks, dtype=torch.int64)
    overlap.index_put_((new_rank, old_rank), torch.ones(experts, dtype=torch.int64), accumulate=True)
    assign: dict[int, int] = {}
    for _, n, o in sorted((-int(overlap[n, o]), n, o) for n in range(ranks) for o in range(ranks)):
        if n not in assign and o not in assign.values():
            assign[n] = o
    out = torch.empty_like(current)
    for n, o in assign.items():
        members = [e for e in range(experts) if int(new_rank[e]) == n]
        staying = [e for e in members if int(old_rank[e]) == o]
        free = sorted(set(range(o * per_rank, (o + 1) * per_rank)) - {int(current[e]) for e in staying})
        for e in staying:
            out[e] = current[e]
        for e, s in zip([e for e in members if e not in staying], free):
            out[e] = s
    return out


def _check_divisible(num_experts: int, ranks: int) -> None:
    if ranks < 1 or num_experts % ranks:
        raise ValueError(f"{num_experts} experts cannot be placed evenly on {ranks} ranks; choose ranks dividing {num_experts}")
