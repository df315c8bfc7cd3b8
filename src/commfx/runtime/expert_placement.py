"""Expert placement and routing statistics: runtime state of `pack_experts`, keyed by op id.

The graph never holds a placement: its `commfx.expert_slots` op asks the runtime where each
chosen expert lives now (slot = rank * E/ranks + local id) and records routing statistics
as it goes (per layer: expert load and co-selection counts; across adjacent layers:
transition counts, how often a token of expert i next goes to expert j). Every N optimizer
steps (`pack_experts:replace_every=N`) the runtime all-reduces the statistics, every rank
runs the same deterministic solver (`placement.solve_slots`) on the same numbers, and
experts whose rank changes are moved, weights and optimizer state together, point to point
from their old rank to their new one (nothing else is sent), so training goes on exactly
as if nothing had moved. A better placement is adopted only where it pays: the
all-to-all bytes it saves a step (each more co-located selection is one row less each way,
forward and backward) must repay the bytes its move sends within `pack_experts:payback`
steps, unless it brings an over-loaded rank back under the balance bound. Placement and
statistics are saved with the module's state_dict.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from ..plan import DEFAULT_CLASS
from .comm import CommError, current_scheduler
from .placement import Placement, RoutingStats, slot_ranks, solve_slots


@dataclass
class ExpertPlacement:
    """Where one MoE layer's experts live. slot_of[e] = rank * (E / ranks) + local id."""

    op_id: str
    num_experts: int
    ranks: int
    slot_of: torch.Tensor = None  # type: ignore[assignment]
    stats: RoutingStats = None  # type: ignore[assignment]
    weights: list[str] = field(default_factory=list)  # parameter targets sharded by slot (dim 0)
    replacements: int = 0
    payback: float = math.inf  # steps within which a move must repay its bytes (pack_experts:payback)
    row_bytes: int = 0  # what one (token, rank) row costs a step on the wire, both ways, forward and backward
    window_start: int = 0  # the optimizer step the statistics were last reset at

    def __post_init__(self):
        if self.slot_of is None:
            self.slot_of = torch.arange(self.num_experts)
        if self.stats is None:
            self.stats = RoutingStats(self.num_experts)

    def record(self, indices: torch.Tensor, previous: torch.Tensor | None) -> None:
        self.stats.observe(indices, previous)

    def state(self) -> dict:
        return {"ranks": self.ranks, "slot_of": self.slot_of.tolist(), "replacements": self.replacements, "stats": self.stats.state_dict(),
                "window_start": self.window_start}

    def load_state(self, state: dict) -> None:
        self.slot_of = torch.tensor(state["slot_of"], dtype=torch.int64)
        self.replacements = int(state["replacements"])
        self.window_start = int(state.get("window_start", 0))
        self.stats = RoutingStats(self.num_experts)
        self.stats.load_state_dict(state["stats"])


class Placements:
    """Every packed layer's placement in one runtime (one comm scheduler), by op id."""

    def __init__(self):
        self.layers: dict[str, ExpertPlacement] = {}

    def get(self, op_id: str, num_experts: int, ranks: int) -> ExpertPlacement:
        placement = self.layers.get(op_id)
        if placement is None:
            placement = self.layers[op_id] = ExpertPlacement(op_id, num_experts, ranks)
        return placement

    def state(self) -> dict:
        return {op_id: p.state() for op_id, p in self.layers.items()}

    def load_state(self, state: dict) -> None:
        for op_id, layer_state in state.items():
            self.get(op_id, len(layer_state["slot_of"]), layer_state["ranks"]).load_state(layer_state)


_BY_SCHEDULER: "weakref.WeakKeyDictionary[object, Placements]" = weakref.WeakKeyDictionary()
_WITHOUT_SCHEDULER = Placements()


def placements_of(scheduler) -> Placements:
    """The placements of the runtime `scheduler` belongs to (created on first use)."""
    if scheduler not in _BY_SCHEDULER:
        _BY_SCHEDULER[scheduler] = Placements()
    return _BY_SCHEDULER[scheduler]


def current_placements() -> Placements:
    """The placements of the runtime running the current graph (ops call this)."""
    try:
        return placements_of(current_scheduler())
    except CommError:  # ops run by hand, outside a runtime (tests)
        return _WITHOUT_SCHEDULER


# ------------------------------------------------------------------------------ re-placement

MOVE_KIND = "expert_move"  # what the comm stats call the moved experts' traffic


@dataclass(frozen=True)
class Decision:
    op_id: str
    moved: int  # experts whose rank changed
    colocated_before: float
    colocated_after: float
    max_load: float
    bound: float
    sent_bytes: int = 0  # what this rank sent of this layer's moved experts (weights and optimizer state)
    step: int = -1  # the optimizer step it followed (-1: not given)
    payback_steps: float = 0.0  # steps the better placement would take to repay its move (0: nothing to move)
    declined: bool = False  # a better placement was found but did not pay back within pack_experts:payback


def payback_steps(colocated_gain: float, window_steps: int, row_bytes: int, move_bytes: int) -> float:
    """Steps until a re-placement's all-to-all savings repay the bytes its move sends.

    `colocated_gain` more co-located selections over a statistics window of `window_steps`
    steps (summed over ranks) save that many rows a step at `row_bytes` each; the move sends
    `move_bytes` (every moved expert's weights and optimizer state) once."""
    if move_bytes <= 0:
        return 0.0
    saved_per_step = colocated_gain / max(window_steps, 1) * row_bytes
    return move_bytes / saved_per_step if saved_per_step > 0 else math.inf


def replace_experts(placements: Placements, scheduler, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, balance: float,
                    step: int = -1) -> list[Decision]:
    """Re-place every layer from the all-reduced statistics and move what changed.

    Collective: every rank calls it at the same point (after the same optimizer step), in
    op-id order. Only experts whose rank changes travel, with every optimizer state tensor
    shaped like their weights (Adam's moments, momentum), point to point from the old owner
    to the new one over the expert-parallel group (`move_experts`); a layer whose better
    placement does not pay back within its `payback` steps (and restores no balance) stays
    as it is (`_adopt`). Statistics restart from zero either way.
    """
    decisions, moves = [], []
    rank = scheduler.group("ep").rank
    for op_id in sorted(placements.layers):
        layer = placements.layers[op_id]
        experts = layer.num_experts
        both = torch.cat([layer.stats.load, layer.stats.co_selected.reshape(-1)])
        scheduler.all_reduce(both, "world", kind="placement_stats")
        summed = RoutingStats(experts)
        summed.load, summed.co_selected = both[:experts].clone(), both[experts:].view(experts, experts).clone()
        solution = solve_slots(summed, layer.ranks, layer.slot_of, balance)
        current = slot_ranks(layer.slot_of, layer.ranks)
        placed = Placement(tuple(int(r) for r in current), layer.ranks)
        before = placed.colocated(summed.co_selected)
        moved = int((slot_ranks(solution.slot_of, layer.ranks) != current).sum())
        tensors = _moving_tensors(layer, module, optimizer)
        window = step - layer.window_start if step > layer.window_start else 1
        repay = payback_steps(solution.colocated - before, window, layer.row_bytes, moved * sum(_row_bytes(t) for t in tensors))
        current_max_load = max(placed.loads(summed.load))
        adopt = _adopt(repay, layer.payback, current_max_load, solution)
        slot_of = solution.slot_of if adopt else layer.slot_of
        plan = plan_move(layer.slot_of, slot_of, layer.ranks, rank)
        if not plan.unchanged:
            moves.append((layer, plan))
        if moved and adopt:
            layer.replacements += 1
        sent = sum(_row_bytes(t) * len(rows) for t in tensors for rows in plan.send.values())
        layer.slot_of = slot_of
        layer.stats = RoutingStats(layer.num_experts)
        layer.window_start = max(step, 0)
        after = solution.colocated if adopt else before
        decisions.append(Decision(op_id, moved if adopt else 0, before, after, solution.max_load if adopt else current_max_load,
                                  solution.bound, sent, step, repay, declined=bool(moved) and not adopt))
    if moves:
        move_experts(moves, scheduler, module, optimizer)
    return decisions


def _adopt(repay: float, payback: float, current_max_load: float, solution) -> bool:
    """Take the solver's placement if it repays its move within `payback` steps, or if it
    lowers the load of a rank now over the balance bound (balance is compute, not bytes)."""
    rebalances = current_max_load > solution.bound + 1e-9 and solution.max_load < current_max_load - 1e-9
    return repay <= payback or rebalances


@dataclass(frozen=True)
class MovePlan:
    """One layer's re-placement as one rank of the ep group sees it (rows are this rank's
    local expert rows; a peer is an index in the ep group). Moving experts of one pair of
    ranks are listed in expert order on both ends, so the sender's rows and the receiver's
    rows line up without being sent."""

    keep: tuple[tuple[int, int], ...]  # (new row, old row): experts that stay on this rank
    send: dict[int, tuple[int, ...]]  # peer -> old rows of the experts it takes over
    recv: dict[int, tuple[int, ...]]  # peer -> new rows of the experts it hands over

    @property
    def unchanged(self) -> bool:
        return not self.send and not self.recv and all(new == old for new, old in self.keep)


def plan_move(old_slot_of: torch.Tensor, new_slot_of: torch.Tensor, ranks: int, rank: int) -> MovePlan:
    """Which of `rank`'s rows stay, go, and arrive when slots change from `old_slot_of` to
    `new_slot_of` (slot = rank * E/ranks + local row)."""
    per_rank = old_slot_of.numel() // ranks
    keep, send, recv = [], {}, {}
    for expert in range(old_slot_of.numel()):
        (old_rank, old_row), (new_rank, new_row) = divmod(int(old_slot_of[expert]), per_rank), divmod(int(new_slot_of[expert]), per_rank)
        if old_rank == rank == new_rank:
            keep.append((new_row, old_row))
        elif old_rank == rank:
            send.setdefault(new_rank, []).append(old_row)
        elif new_rank == rank:
            recv.setdefault(old_rank, []).append(new_row)
    return MovePlan(tuple(keep), {p: tuple(r) for p, r in sorted(send.items())}, {p: tuple(r) for p, r in sorted(recv.items())})


def move_experts(moves: list[tuple[ExpertPlacement, MovePlan]], scheduler, module: torch.nn.Module, optimizer) -> None:
    """Rewrite this rank's expert shards (and their optimizer state) for the new slots.

    Every row an expert leaves is sent, weights and optimizer state of every moved layer
    together, as one message per peer and dtype, to its new owner; experts that stay on
    this rank are permuted locally (no bytes). Sends and receives go through the scheduler
    (counted as `expert_move`, each wait bounded by its timeout), one lane per peer and
    direction so that no send waits behind a receive or another peer. Collective: every
    rank of the ep group calls it with the same layers in the same order."""
    outgoing: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # (peer, dtype) -> flat pieces, in order
    incoming: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, tuple[int, ...]]]] = {}  # -> (tensor, new rows)
    kept = []  # (tensor, new rows, old rows' values), taken before anything is overwritten
    for layer, plan in moves:
        for tensor in _moving_tensors(layer, module, optimizer):
            for peer, rows in plan.send.items():
                outgoing.setdefault((peer, tensor.dtype), []).append(tensor[list(rows)].reshape(-1))
            for peer, rows in plan.recv.items():
                incoming.setdefault((peer, tensor.dtype), []).append((tensor, rows))
            if plan.keep and any(new != old for new, old in plan.keep):
                new_rows, old_rows = zip(*plan.keep)
                kept.append((tensor, list(new_rows), tensor[list(old_rows)]))
    sends = [scheduler.start_send(torch.cat(pieces), "ep", peer, kind=MOVE_KIND, priority=DEFAULT_CLASS, lane=f"{MOVE_KIND}>{peer}")
             for (peer, _), pieces in outgoing.items()]
    receives = []
    for (peer, dtype), targets in incoming.items():
        buffer = torch.empty(sum(_row_numel(t) * len(rows) for t, rows in targets), dtype=dtype, device=targets[0][0].device)
        receives.append((buffer, targets, scheduler.start_recv(buffer, "ep", peer, kind=MOVE_KIND, priority=DEFAULT_CLASS, lane=f"{MOVE_KIND}<{peer}")))
    with torch.no_grad():
        for tensor, new_rows, values in kept:
            tensor[new_rows] = values
        for buffer, targets, pending in receives:
            scheduler.wait(pending)
            offset = 0
            for tensor, rows in targets:
                size = _row_numel(tensor) * len(rows)
                tensor[list(rows)] = buffer[offset : offset + size].view(len(rows), *tensor.shape[1:])
                offset += size
    for pending in sends:
        scheduler.wait(pending)


def _moving_tensors(layer: ExpertPlacement, module: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """What moves with a layer's experts, in the same order on every rank: each expert
    parameter (rows = local experts), then each optimizer state tensor shaped like it
    (by state key); scalar state (Adam's step) is the same for every row and stays."""
    tensors = []
    for target in layer.weights:
        param = module.get_parameter(target)
        tensors.append(param.data)
        if optimizer is not None:
            state = optimizer.state.get(param, {})
            tensors += [state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor) and state[key].shape == param.shape]
    return tensors


def _row_numel(tensor: torch.Tensor) -> int:
    return tensor[0].numel() if tensor.shape[0] else 0


def _row_bytes(tensor: torch.Tensor) -> int:
    return _row_numel(tensor) * tensor.element_size()
