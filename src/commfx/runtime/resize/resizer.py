"""`Resizer`: the resizable linears of one module on this rank and their plans, changed
between steps by the decisions (resize, migrate, resize_units, move_units), saved and
restored with the module's state."""

from __future__ import annotations

import math

import torch

from .columns import priority_columns
from .linear_plan import LinearPlan, Migration, state_key, units_key
from .units import UnitBlock, UnitSlots


def _check_unit_fraction(fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a resize fraction must be in (0, 1] (the share of units a rank keeps), got {fraction}")


class Resizer:
    """The resizable linears of one module on this rank and their current plans.

    `linears`: key -> (weight parameter, "column" | "row"); the contraction dim is dim 1.
    `units`: the blocks whose units can move (unit migration), keyed by their row linear;
    moving them is collective over `group` through `scheduler`.
    """

    def __init__(self, linears: dict[str, tuple[torch.Tensor, str]], op_state: dict, tp_rank: int, tp_size: int,
                 units: dict[str, UnitBlock] | None = None, params: dict[str, torch.nn.Parameter] | None = None,
                 scheduler=None, group: str = "tp"):
        self.linears = linears
        self.op_state = op_state
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.fraction = 1.0  # kept fraction on this rank (1: full width)
        self.migration: dict | None = None  # {"giver", "taker", "fraction"} in tp indices
        self.snapshots: dict[str, torch.Tensor] = {}  # weights at the last selection
        for key, (weight, kind) in linears.items():
            op_state[state_key(key)] = LinearPlan(key, kind, weight.shape[1], tp_rank, out_width=weight.shape[0])
        self.units = units or {}
        self.params = params or {}  # name -> parameter, for every weight and bias a unit spans
        self.scheduler, self.group = scheduler, group
        self.optimizer: torch.optim.Optimizer | None = None  # its state moves with the units (attach_optimizer)
        self.unit_migration: dict | None = None  # {"giver", "taker", "counts": {block: units}} in force
        self.pending: dict | None = None  # ... requested, moved at the next step's start
        self.moved_bytes = 0  # bytes the last move sent (weights and optimizer state)
        # Unit resizing (ZERO-resizing by whole units, where blocks have units): this rank
        # computes only the first `unit_kept[block]` units of its shard; the units are ordered
        # by priority first (the shard permuted between steps, see `_order_units`).
        self.unit_kept: dict[str, int] | None = None
        self.unit_fraction = 1.0  # the kept fraction asked for (of the units not given away)
        self.pending_fraction: float | None = None  # ... requested, applied at the next step's start
        self.unit_snapshots: dict[str, list[torch.Tensor]] = {}  # each block's weights at the last selection
        self.unit_order: dict[str, list[int]] = {}  # per block, the unit at each position of the shard (absent: in order)
        self.slots = UnitSlots()
        for key, block in self.units.items():
            op_state[units_key(key)] = block
            block.slots = []
            for i, (name, dim, _layout) in enumerate(block.tensors):
                shape = list(self.params[name].shape)
                shape[dim] = 0
                slot = torch.nn.Parameter(self.params[name].detach().new_empty(shape))
                self.slots.register_parameter(f"{key.replace('.', '_')}__{i}", slot)
                block.slots.append(slot)

    def plan(self, key: str) -> LinearPlan:
        return self.op_state[state_key(key)]

    def resize(self, fraction: float, kept: dict[str, list[int]] | None = None) -> None:
        """Keep `fraction` of this rank's contraction columns, chosen by priority (1.0: full
        width again); `kept` names the columns instead (tests: every column)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"a resize fraction must be in (0, 1] (the share of columns a rank keeps), got {fraction}")
        self.fraction = fraction
        for key, (weight, _kind) in self.linears.items():
            plan = self.plan(key)
            if kept is not None:
                plan.columns.kept = sorted(kept[key])
            elif fraction >= 1.0:
                plan.columns.kept = None
            else:
                plan.columns.kept = priority_columns(weight, self.snapshots.get(key), max(1, math.ceil(fraction * plan.width)))
                self.snapshots[key] = weight.detach().clone()
            if plan.columns.kept is None:
                plan.error = 0.0
            plan.changed()

    def migrate(self, giver: int, taker: int, fraction: float) -> None:
        """Hand `fraction` of the giver's row-parallel contraction columns (its last ones) to
        the taker, both tp indices; fraction 0 undoes it."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"a migration fraction must be in [0, 1), got {fraction}")
        if fraction > 0 and (giver == taker or not (0 <= giver < self.tp_size and 0 <= taker < self.tp_size)):
            raise ValueError(f"migration needs two different tp ranks in [0, {self.tp_size}), got giver {giver}, taker {taker}")
        self.migration = {"giver": giver, "taker": taker, "fraction": fraction} if fraction > 0 else None
        for key, (_weight, kind) in self.linears.items():
            plan = self.plan(key)
            count = int(round(fraction * plan.width)) if kind == "row" else 0
            plan.columns.migration = Migration(giver, taker, tuple(range(plan.width - count, plan.width))) if count else None
            plan.columns.stash.clear()
            plan.changed()

    def restore(self) -> None:
        """Full width and no migration: plain tensor parallelism (moved units come back at the
        next step's start, `apply_pending`)."""
        self.resize(1.0)
        self.migrate(0, 0, 0.0)
        if self.unit_migration is not None or self.pending is not None:
            self.request_units(0, 0, {})
        if self.unit_kept is not None or self.pending_fraction is not None or self.unit_order:
            self.request_unit_resize(1.0)  # ... and the units back in their own order

    # -- unit migration ---------------------------------------------------------------

    def unit_counts(self, fraction: float) -> dict[str, int]:
        """Units per block that move for `fraction` of a rank's share (rounded per block)."""
        return {key: min(block.units - 1, int(round(fraction * block.units))) for key, block in self.units.items()}

    def moved_share(self, counts: dict[str, int]) -> float:
        """The share of a rank's tp multiply-adds that `counts` moves (blocks weighted by weight size)."""
        total = sum(w.numel() for w, _ in self.linears.values())
        moved = 0.0
        for key, block in self.units.items():
            size = sum(self.params[name].numel() for name, dim, _ in block.tensors if name in self.linears)
            moved += size * counts.get(key, 0) / block.units
        return moved / total if total else 0.0

    def request_units(self, giver: int, taker: int, counts: dict[str, int]) -> None:
        """Ask for `counts` units of each block of the giver to be computed by the taker (empty:
        none), moved by the next `apply_pending` (the controller calls it at a step's start)."""
        counts = {k: int(n) for k, n in counts.items() if n}
        self.pending = {"giver": giver, "taker": taker, "counts": counts} if counts else {"giver": 0, "taker": 0, "counts": {}}

    def apply_pending(self) -> int:
        """Move what `request_units` asked for (collective: every rank of the tp group calls it
        at the same point, between steps). Returns the bytes moved."""
        moved = 0
        if self.pending is not None:
            pending, self.pending = self.pending, None
            moved = self.move_units(pending["giver"], pending["taker"], pending["counts"])
            if self.unit_kept is not None and self.pending_fraction is None:
                self.pending_fraction = self.unit_fraction  # other units given away: choose the kept ones anew
        if self.pending_fraction is not None:
            fraction, self.pending_fraction = self.pending_fraction, None
            self.resize_units(fraction)
        return moved

    # -- unit resizing ------------------------------------------------------------------

    def request_unit_resize(self, fraction: float) -> None:
        """Ask for this rank to keep `fraction` of its units (those not given away; 1.0: all),
        applied by the next `apply_pending`, between steps: choosing the units reorders the
        shard, which must not happen between a backward and its optimizer step."""
        _check_unit_fraction(fraction)
        self.pending_fraction = fraction

    def given_units(self, key: str) -> int:
        migration = self.unit_migration
        return migration["counts"].get(key, 0) if migration and migration["giver"] == self.tp_rank else 0

    def resize_units(self, fraction: float) -> None:
        """Keep `fraction` of each block's units that this rank computes itself (ZERO-resizing
        by whole heads and MLP column blocks): the units whose weights changed most since the
        last selection (the largest at the first) are moved to the front of the shard, and the
        linears compute on views of them, so no step gathers anything. Local: permuting units
        within a shard changes no other rank's work (the row-parallel sum runs over them)."""
        _check_unit_fraction(fraction)
        self.unit_fraction = fraction
        if fraction >= 1.0:  # every unit computed again, back in their own order where not given away
            self.unit_kept = None
            self.unit_snapshots = {}
            for key, block in self.units.items():
                current, available = self.unit_order.get(key, list(range(block.units))), block.units - self.given_units(key)
                self._permute(key, block, sorted(range(available), key=lambda p: current[p]) + list(range(available, block.units)))
        else:
            self.unit_kept = {}
            for key, block in self.units.items():
                available = block.units - self.given_units(key)
                keep = min(available, max(1, math.ceil(fraction * available - 1e-9)))
                self._order_units(key, block, available, keep)
                self.unit_kept[key] = keep
        self._set_unit_plans()

    def _order_units(self, key: str, block: UnitBlock, available: int, keep: int) -> None:
        """Put the `keep` units (of the first `available`) whose weights changed most since the
        last selection first, in their current order, by permuting the shard's weights, their
        gradients and their optimizer state along the unit axis; then snapshot the weights."""
        tensors = [self.params[name] for name, _dim, _layout in block.tensors]
        snapshot = self.unit_snapshots.get(key)
        scores = []
        for u in range(available):
            score = 0.0
            for i, (param, (_name, dim, layout)) in enumerate(zip(tensors, block.tensors)):
                index = block.index(layout, u, 1)
                change = param.detach().index_select(dim, index)
                if snapshot is not None:
                    change = change - snapshot[i].index_select(dim, index)
                score += float(change.double().pow(2).sum())
            scores.append(score)
        ranked = sorted(range(available), key=lambda u: (-scores[u], u))
        kept = sorted(ranked[:keep])
        self._permute(key, block, kept + [u for u in range(available) if u not in kept] + list(range(available, block.units)))
        self.unit_snapshots[key] = [param.detach().clone() for param in tensors]

    def _permute(self, key: str, block: UnitBlock, order: list[int]) -> None:
        """Reorder the units of this rank's shard of `block`: position i takes the unit at
        position order[i], in every weight of the block, its gradient and its optimizer state
        (exact copies; the block computes the same function, its row-parallel sum in another
        order). `unit_order` remembers where each unit is, so full width puts them back."""
        if order == list(range(block.units)):
            return
        for name, dim, layout in block.tensors:
            param = self.params[name]
            index = block.order_index(layout, order)
            state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
            for tensor in [param.data, param.grad, *(v for v in state.values() if isinstance(v, torch.Tensor))]:
                if tensor is not None and tensor.shape == param.shape:
                    tensor.copy_(tensor.index_select(dim, index))
        current = self.unit_order.get(key, list(range(block.units)))
        self.unit_order[key] = [current[p] for p in order]
        if self.unit_order[key] == list(range(block.units)):
            del self.unit_order[key]

    def kept_share(self) -> float:
        """The share of this rank's tp multiply-adds it computes itself (1: all of them)."""
        if self.unit_kept is None:
            return self.fraction
        dropped = {key: block.units - self.given_units(key) - self.unit_kept.get(key, block.units) for key, block in self.units.items()}
        return 1.0 - self.moved_share(dropped)

    def move_units(self, giver: int, taker: int, counts: dict[str, int]) -> int:
        """Have the taker compute the giver's last `counts[block]` units of each block, from now
        on (collective over the tp group, between steps): the current migration's units move
        back first, then the new ones move, weights and optimizer state. {}: none moved."""
        counts = {k: int(n) for k, n in counts.items() if n}
        new = {"giver": giver, "taker": taker, "counts": counts} if counts else None
        if new is not None:
            if giver == taker or not (0 <= giver < self.tp_size and 0 <= taker < self.tp_size):
                raise ValueError(f"unit migration needs two different tp ranks in [0, {self.tp_size}), got giver {giver}, taker {taker}")
            for key, n in counts.items():
                if key not in self.units or not 0 < n < self.units[key].units + 1:
                    raise ValueError(f"block {key} cannot move {n} units (it has {self.units.get(key) and self.units[key].units} per rank)")
        if new == self.unit_migration:
            return 0
        moved = 0
        if self.unit_migration is not None:
            moved += self._transfer(self.unit_migration, back=True)
        if new is not None:
            moved += self._transfer(new, back=False)
        self.unit_migration = new
        self._set_unit_plans()
        self.moved_bytes = moved
        return moved

    def _state_names(self, param: torch.Tensor) -> list[str]:
        state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape)

    def _transfer(self, migration: dict, back: bool) -> int:
        """Move the units of `migration` from the giver's shard to the taker's slots (or back,
        `back`): each rank puts what it sends into a zero buffer and the group sums it (exact:
        x + 0 == x), in block order, weight then its optimizer state, on every rank alike."""
        giver, taker, me = migration["giver"], migration["taker"], self.tp_rank
        if self.optimizer is not None and not back:
            optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            missing = [key for key, block in self.units.items() if any(id(slot) not in optimized for slot in block.slots)]
            if missing:
                raise ValueError(
                    "the attached optimizer does not hold resize_tp's unit slots (module.tp_slots), so units moved to "
                    "a faster rank would not train: build it over the distributed module's parameters(), not .module's"
                )
        moved = 0
        for key in sorted(migration["counts"]):
            block, count = self.units[key], migration["counts"][key]
            for (name, dim, layout), slot in zip(block.tensors, block.slots):
                param = self.params[name]
                index = block.index(layout, block.units - count, count)
                shape = list(param.shape)
                shape[dim] = index.numel()
                names = self._state_names(param)
                param_state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
                slot_state = self.optimizer.state.get(slot, {}) if self.optimizer is not None else {}
                for j, what in enumerate([None, *names]):
                    source = param.data if what is None else param_state[what]
                    buffer = param.data.new_zeros(shape) if what is None else source.new_zeros(shape)
                    if not back and me == giver:
                        buffer.copy_(source.index_select(dim, index))
                    if back and me == taker:
                        buffer.copy_(slot.data if what is None else slot_state[what])
                    self.scheduler.all_reduce(buffer, self.group, kind="tp_unit_move")
                    moved += buffer.numel() * buffer.element_size()
                    if back and me == giver:
                        source.index_copy_(dim, index, buffer)
                    if not back and me == taker:
                        if what is None:
                            slot.data = buffer
                        else:
                            self.optimizer.state[slot][what] = buffer
                if not back and me == taker and self.optimizer is not None and param in self.optimizer.state:
                    for what, value in param_state.items():  # the step count and other scalars: as the taker's own
                        if what not in names:
                            self.optimizer.state[slot][what] = value.clone() if isinstance(value, torch.Tensor) else value
                if back and me == taker:
                    empty = list(param.shape)
                    empty[dim] = 0
                    slot.data = param.data.new_empty(empty)
                    if self.optimizer is not None:
                        self.optimizer.state.pop(slot, None)
                slot.grad = None
        return moved

    def _set_unit_plans(self) -> None:
        """The giver skips its moved units' rows and columns; the taker computes them."""
        migration = self.unit_migration
        for key, block in self.units.items():
            count = migration["counts"].get(key, 0) if migration else 0
            block.taken = count if migration is not None and migration["taker"] == self.tp_rank else 0
            given = self.given_units(key)
            dropped = 0 if self.unit_kept is None else max(0, block.units - given - self.unit_kept[key])
            skipped = given + dropped  # the last units: given away, and before them those resizing drops
            block.stash.clear()
            for name, dim, layout in block.tensors:
                if name not in self.linears:
                    continue  # a bias: skipped with its weight's rows
                plan = self.plan(name)
                index = tuple(block.index(layout, block.units - skipped, skipped).tolist()) if skipped else ()
                if dim == 0:
                    plan.units.skip_rows = index
                else:
                    plan.units.skip_columns = index
                outer, per, inner = layout
                size = per // block.units
                plan.units.cut = (outer, per, inner, per - skipped * size) if skipped else None
                plan.units.dropped = dropped * size
                if not dropped:
                    plan.error = 0.0
                plan.changed()

    def error(self) -> float:
        """Largest relative error a resized linear made in the last forward (0 when none is)."""
        return max((self.plan(key).error for key in self.linears if self.plan(key).columns.kept is not None or self.plan(key).units.dropped), default=0.0)

    def migration_bytes(self, element_size: int) -> int:
        """Bytes the current migration moves per step (forward: X_M and W_M; backward: their gradients)."""
        total = 0
        for key, (weight, _kind) in self.linears.items():
            plan = self.plan(key)
            if plan.columns.migration is not None:
                total += 2 * len(plan.columns.migration.columns) * (weight.shape[0] + plan.rows) * element_size
        return total

    def state_dict(self) -> dict:
        return {
            "fraction": self.fraction,
            "kept": {key: self.plan(key).columns.kept for key in self.linears},
            "migration": self.migration,
            "snapshots": {key: t.clone() for key, t in self.snapshots.items()},
            "unit_migration": self.unit_migration,
            "pending": self.pending,
            "unit_kept": self.unit_kept,
            "unit_fraction": self.unit_fraction,
            "pending_fraction": self.pending_fraction,
            "unit_snapshots": {key: [t.clone() for t in ts] for key, ts in self.unit_snapshots.items()},
            "unit_order": {key: list(order) for key, order in self.unit_order.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.fraction = state["fraction"]
        for key, kept in state["kept"].items():
            self.plan(key).columns.kept = kept
            self.plan(key).changed()
        self.snapshots = {key: t.clone() for key, t in state.get("snapshots", {}).items()}
        migration = state.get("migration")
        self.migrate(migration["giver"], migration["taker"], migration["fraction"]) if migration else self.migrate(0, 0, 0.0)
        # Which units are where: the slots and shards themselves are parameters, loaded with
        # the module's state_dict (UnitSlots takes the saved sizes); nothing moves here.
        self.unit_migration, self.pending = state.get("unit_migration"), state.get("pending")
        # the units' order is in the (loaded) parameters; which of them are kept is here
        self.unit_kept, self.unit_fraction = state.get("unit_kept"), state.get("unit_fraction", 1.0)
        self.pending_fraction = state.get("pending_fraction")
        self.unit_snapshots = {key: [t.clone() for t in ts] for key, ts in state.get("unit_snapshots", {}).items()}
        self.unit_order = {key: list(order) for key, order in state.get("unit_order", {}).items()}
        self._set_unit_plans()
