"""Expert placement and routing statistics: runtime state of `pack_experts`, keyed by op id.

The graph never holds a placement: its `commfx.expert_slots` op asks the runtime where each
chosen expert lives now (slot = rank * E/ranks + local id) and records routing statistics
as it goes (per layer: expert load and co-selection counts; across adjacent layers:
transition counts, how often a token of expert i next goes to expert j). Every N optimizer
steps (`pack_experts:replace_every=N`) the runtime all-reduces the statistics, every rank
runs the same deterministic solver (`placement.solve_slots`) on the same numbers, and
experts whose rank changes are moved, weights and optimizer state together, so training
goes on exactly as if nothing had moved. Placement and statistics are saved with the
module's state_dict.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

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

    def __post_init__(self):
        if self.slot_of is None:
            self.slot_of = torch.arange(self.num_experts)
        if self.stats is None:
            self.stats = RoutingStats(self.num_experts)

    def record(self, indices: torch.Tensor, previous: torch.Tensor | None) -> None:
        self.stats.observe(indices, previous)

    def state(self) -> dict:
        return {"ranks": self.ranks, "slot_of": self.slot_of.tolist(), "replacements": self.replacements, "stats": self.stats.state_dict()}

    def load_state(self, state: dict) -> None:
        self.slot_of = torch.tensor(state["slot_of"], dtype=torch.int64)
        self.replacements = int(state["replacements"])
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


@dataclass(frozen=True)
class Decision:
    op_id: str
    moved: int  # experts whose rank changed
    colocated_before: float
    colocated_after: float
    max_load: float
    bound: float


def replace_experts(placements: Placements, scheduler, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, balance: float) -> list[Decision]:
    """Re-place every layer from the all-reduced statistics and move what changed.

    Collective: every rank calls it at the same point (after the same optimizer step), in
    op-id order. Expert weights (and each optimizer state tensor shaped like them: Adam's
    moments, momentum) move over the expert-parallel group; statistics restart from zero.
    """
    decisions = []
    for op_id in sorted(placements.layers):
        layer = placements.layers[op_id]
        experts = layer.num_experts
        both = torch.cat([layer.stats.load, layer.stats.co_selected.reshape(-1)])
        scheduler.all_reduce(both, "world", kind="placement_stats")
        summed = RoutingStats(experts)
        summed.load, summed.co_selected = both[:experts].clone(), both[experts:].view(experts, experts).clone()
        solution = solve_slots(summed, layer.ranks, layer.slot_of, balance)
        current = slot_ranks(layer.slot_of, layer.ranks)
        before = Placement(tuple(int(r) for r in current), layer.ranks).colocated(summed.co_selected)
        moved = int((slot_ranks(solution.slot_of, layer.ranks) != current).sum())
        if moved:
            _move_experts(layer, solution.slot_of, scheduler, module, optimizer)
            layer.replacements += 1
        layer.slot_of = solution.slot_of
        layer.stats = RoutingStats(layer.num_experts)
        decisions.append(Decision(op_id, moved, before, solution.colocated, solution.max_load, solution.bound))
    return decisions


def _move_experts(layer: ExpertPlacement, new_slot_of: torch.Tensor, scheduler, module: torch.nn.Module, optimizer) -> None:
    """Rewrite this rank's expert shards (and their optimizer state) for `new_slot_of`.

    Each rank puts its shard in its slots of a zero tensor of all E slots; a sum over the ep
    group gathers them exactly (x + 0 == x); each rank then takes the rows of its new slots."""
    handle = scheduler.group("ep")
    per_rank = layer.num_experts // layer.ranks
    # expert now in new slot s (this rank's) came from old slot source[s]
    expert_in_new_slot = torch.empty_like(new_slot_of)
    expert_in_new_slot[new_slot_of] = torch.arange(layer.num_experts)
    mine = expert_in_new_slot[handle.rank * per_rank : (handle.rank + 1) * per_rank]
    source = layer.slot_of[mine]
    for target in layer.weights:
        param = module.get_parameter(target)
        tensors = [param.data]
        if optimizer is not None:
            tensors += [t for t in optimizer.state.get(param, {}).values() if isinstance(t, torch.Tensor) and t.shape == param.shape]
        for tensor in tensors:
            full = tensor.new_zeros((layer.num_experts, *tensor.shape[1:]))
            full[handle.rank * per_rank : (handle.rank + 1) * per_rank] = tensor
            scheduler.all_reduce(full, "ep", kind="expert_move")
            tensor.copy_(full[source.to(full.device)])
