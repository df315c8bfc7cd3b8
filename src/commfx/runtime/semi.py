"""SEMI-migration: find a straggler from step timings and resize or migrate its shard.

Every rank of a tensor-parallel group times its own compute per step (time not spent
waiting on collectives) and the group all-gathers the numbers, so every rank holds the
same list and every decision below, a pure function of it, is the same on every rank.
Over a window of steps each rank's time is modelled as affine in the work it was given
(kept fraction, migrated share): t = a + b w, with a the part that does not shrink with
its shard (attention scores, norms, the loss, resizing's own gathers) and b the time per
whole shard, fitted by least squares over the recent windows once their work levels differ;
until then (or where the line is not physical: a < 0 or b <= 0) the controller takes
t = b w, and a window far off the line (the rank recovered or slowed further) starts the
fit anew. Each rank's full-width time a + b is what it is compared on, which keeps a resized
straggler from looking cured, and the kept fraction solves a + b f = the others' time,
rather than 1/ratio, which would resize ever harder while the fixed part stays. A rank
slower than the median of the others by `threshold` is a straggler:

- light or transient slowness: **resize** it to the speed ratio (ZERO-resizing, lossy; by
  whole units where the blocks have them, see resize/);
- heavy (>= `heavy_ratio`) and persistent (`persist_windows` windows in a row), and moving
  costs less link time per step than the straggler's excess compute: **migrate** the share
  that balances the two ranks (lossless), m = (T_s - T_o) / (b_s + b_o) from the fits (the
  straggler's and the others' full-width times and times per shard). With unit migration
  (the default, `migrate=units`) whole heads and MLP column blocks move, rounded per block,
  their weights and optimizer state once per decision (moved at the next step's start,
  `Resizer.apply_pending`), so nothing moves per step; with column migration
  (`migrate=columns`) only row-parallel columns can move, so where `max_migrate` of them
  cannot balance the ranks, SEMI migrates that much and resizes the straggler for the rest
  (most of the gap closed losslessly, the remainder by resizing). Under unit migration,
  balancing is lossless but bounded (a half-speed rank balanced with a healthy one leaves
  both at 4/3 of a healthy step, and the healthy rank does the extra work), so SEMI aims at
  a step of (1 + `tolerance`) x the others': the others take only the units that fit in that
  budget and the straggler keeps the share of the rest that meets it, resizing by whole units
  (`_units_decision`; `tolerance=inf`: lossless only, migration and no resizing);
- a migration after which a step takes longer than a step at full width did before it
  (measured in each of the `persist_windows` windows right after it starts: one slow window
  may be the machine's, and later windows would blame it for the machine's drift) is
  undone for resizing, and SEMI does not migrate
  again until the rank recovers: the cost model can be wrong (migrated columns wait on the
  straggler's own input), the measurement is not;
- recovered: full width and no migration again.

Each decision is logged with its numbers (ratio, excess seconds, bytes and seconds to move,
and for unit migration the units moved per block and the bytes moved once).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from ..plan import Topology
from .resize.resizer import Resizer
from .resize.units import UnitBlock


@dataclass(frozen=True)
class SemiConfig:
    mode: str = "semi"  # semi | resize | migrate | off
    window: int = 4
    threshold: float = 0.15
    min_fraction: float = 0.25
    max_migrate: float = 0.75
    heavy_ratio: float = 1.5
    persist_windows: int = 2
    migrate: str = "units"  # units | columns (what a migration moves; see resize/)
    tolerance: float = 0.05  # unit SEMI: the step it aims at, over the others' (inf: lossless only)


@dataclass
class Decision:
    step: int
    action: str  # resize | migrate | restore | keep
    straggler: int | None
    ratio: float  # straggler's time per unit of work over the median of the others
    excess_s: float  # straggler's extra compute per step at full width
    move_bytes: int  # what migration would move per step
    move_s: float  # ... over the link
    fraction: float  # kept fraction (resize) or migrated fraction (migrate)
    why: str
    keep: float = 1.0  # migrate: the fraction the straggler also keeps (< 1 where migration alone cannot balance)
    detail: str = ""  # unit migration: the units moved per block, to which rank, and the bytes moved once

    def line(self) -> str:
        who = f"rank {self.straggler}" if self.straggler is not None else "no straggler"
        also = f", keep {self.keep:.2f}" if self.keep < 1.0 else ""
        return (
            f"step {self.step}: {self.action} ({who}, ratio {self.ratio:.2f}, excess {self.excess_s * 1e3:.1f} ms/step, "
            f"migration {self.move_bytes:,} B = {self.move_s * 1e3:.1f} ms/step, fraction {self.fraction:.2f}{also}): {self.why}"
            + (f"; {self.detail}" if self.detail else "")
        )


@dataclass
class SemiState:
    """What the controller remembers between windows (all ranks hold the same)."""

    samples: list[list[float]] = field(default_factory=list)  # per step: every rank's compute seconds
    work: list[list[float]] = field(default_factory=list)  # per step: every rank's share of its work
    persistent: int = 0  # windows in a row with the same straggler
    last_straggler: int | None = None
    action: str = "keep"  # what is in force: keep | resize | migrate
    step: int = 0
    windows: list[list[list[float]]] = field(default_factory=list)  # recent windows: [median step times, mean work]
    step_walls: list[float] = field(default_factory=list)  # per step: the slowest rank's wall time
    # SEMI checks a migration against doing nothing: the step time of the latest window at
    # full width; a migration measured slower is not tried again until a recovery.
    full_width_step_s: float = 0.0
    before_migration_s: float = 0.0
    migration_failed: str = ""  # why, once measured slower
    slower_windows: int = 0  # windows in a row under migration measured slower than full width
    migration_windows: int = 0  # windows since the migration in force started


HISTORY = 8  # windows kept for the affine fit
MIN_WORK_SPREAD = 0.1  # the windows fit a line only if their work levels span this much
MIGRATION_MARGIN = 0.05  # a migration whose step is this much slower than a full-width step failed
CHANGED = 0.4  # a window this far (relative) off the fit so far: the rank's speed changed
UNIT_HYSTERESIS = 0.1  # unit migration: units in force stay where a new decision moves less than this much more or less work


def affine_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares t = a + b w over (work, time) points; None where the work levels are too
    close to tell a from b, or the line is not physical (b <= 0 or a < 0)."""
    works = [w for w, _ in points]
    if len(points) < 2 or max(works) - min(works) < MIN_WORK_SPREAD:
        return None
    mean_w = statistics.fmean(works)
    mean_t = statistics.fmean(t for _, t in points)
    slope = sum((w - mean_w) * (t - mean_t) for w, t in points) / sum((w - mean_w) ** 2 for w in works)
    intercept = mean_t - slope * mean_w
    return (intercept, slope) if slope > 0 and intercept >= 0 else None


def _trimmed(windows: list[list[list[float]]]) -> list[list[list[float]]]:
    """The last HISTORY windows, plus the latest older one whose work differs from the newest
    for some rank: a rank held at one width for a long time keeps the lever arm of its fit."""
    recent = windows[-HISTORY:]
    newest_work = windows[-1][1]
    spread = lambda ws: any(abs(w[1][r] - newest_work[r]) >= MIN_WORK_SPREAD for w in ws for r in range(len(newest_work)))  # noqa: E731
    if spread(recent):
        return recent
    older = [w for w in windows[:-HISTORY] if spread([w])]
    return older[-1:] + recent


def full_width_times(times: list[float], work: list[float], state: "SemiState", units: bool = False) -> tuple[list[float], list[tuple[float, float]]]:
    """Each rank's time at full width (work 1) and its fit (a, b) of t = a + b w over the
    recent windows and this one (t = b w where no line fits). A window far off the line the
    earlier ones fit (a rank that recovered or slowed down) starts the history anew. Windows
    run under a column migration are not fitted (the fit of the windows before stands: their
    times hold the hand-offs); under unit migration (`units`) they are, at each rank's share."""
    def points(r: int, windows) -> list[tuple[float, float]]:
        return [(past_work[r], past_times[r]) for past_times, past_work in windows]

    if state.action == "migrate" and not units:
        # Compute times under migration include its hand-offs: not fitted. The fit of the
        # windows before stands, unless time per unit of work now reads faster (a recovery).
        fits = []
        for r, (t, w) in enumerate(zip(times, work)):
            proportional = (0.0, t / max(w, 1e-9))
            fit = affine_fit(points(r, state.windows)) or proportional
            fits.append(min(fit, proportional, key=sum))
        return [a + b for a, b in fits], fits
    for r, (t, w) in enumerate(zip(times, work)):
        fit = affine_fit(points(r, state.windows))
        if fit is not None and abs(fit[0] + fit[1] * w - t) > CHANGED * max(t, 1e-12):
            state.windows = []
            break
    state.windows = _trimmed(state.windows + [[list(times), list(work)]])
    full, fits = [], []
    for r, (t, w) in enumerate(zip(times, work)):
        fit = affine_fit(points(r, state.windows)) or (0.0, t / max(w, 1e-9))
        fits.append(fit)
        full.append(fit[0] + fit[1])
    return full, fits


def decide(
    times: list[float], work: list[float], state: SemiState, config: SemiConfig, bytes_per_column_step: float, bandwidth: float,
    migratable: float = 1.0, step_s: float | None = None, unit_share: float = 0.0,
) -> Decision:
    """The decision for one window (pure: the same inputs give the same decision on every rank).

    `times`/`work`: each rank's mean compute seconds and work share over the window;
    `bytes_per_column_step`: bytes migration moves per step per fraction of a shard moved;
    `migratable`: the share of a rank's tp work that migration can move (its row-parallel linears);
    `step_s`: the window's step wall time (default: the slowest rank's compute time);
    `unit_share`: unit migration moves no unit of any block below this fraction (rounding).
    """
    speed, fits = full_width_times(times, work, state, units=config.migrate == "units")
    straggler = max(range(len(speed)), key=lambda r: (speed[r], -r))
    others = [speed[r] for r in range(len(speed)) if r != straggler] or [speed[straggler]]
    ratio = speed[straggler] / max(statistics.median(others), 1e-12)
    # What the straggler would cost per step were nothing done (time per whole shard of work),
    # so a working remedy does not talk itself out of being needed.
    excess = max(0.0, speed[straggler] - statistics.median(others))
    state.persistent = state.persistent + 1 if state.last_straggler == straggler and ratio >= 1 + config.threshold else 0
    state.last_straggler = straggler if ratio >= 1 + config.threshold else None
    # a_s + b_s (1 - a m) == a_o + b_o (1 + a m) balances the ranks, a = the migratable share
    # of the work (with no fixed part: (1 - a m) ratio == 1 + a m)
    per_shard_others = statistics.median([fits[r][1] for r in range(len(fits)) if r != straggler] or [fits[straggler][1]])
    needed = (speed[straggler] - statistics.median(others)) / max(fits[straggler][1] + per_shard_others, 1e-12) / max(migratable, 1e-9)
    migrate_fraction = min(config.max_migrate, needed)
    moved = migratable * migrate_fraction
    # resize the rest: a_s + b_s (1 - moved) k == T_o + b_o moved (k = (1 + moved) / (ratio (1 - moved)) with no fixed part)
    keep_after = min(1.0, max(config.min_fraction, (statistics.median(others) + per_shard_others * moved - fits[straggler][0])
                               / max(fits[straggler][1] * (1 - moved), 1e-12)))
    move_bytes = int(bytes_per_column_step * migrate_fraction)
    move_s = move_bytes / bandwidth if bandwidth else 0.0
    # a + b f = the others' time (their full-width time: they keep full width)
    fixed, per_shard = fits[straggler]
    keep_fraction = max(config.min_fraction, min(1.0, (statistics.median(others) - fixed) / max(per_shard, 1e-12)))

    def made(action, fraction, why, keep=1.0):
        state.action = action if action != "restore" else "keep"
        return Decision(state.step, action, straggler if action != "restore" else None, ratio, excess, move_bytes, move_s, fraction, why, keep)

    if ratio < 1 + config.threshold:
        state.migration_failed, state.before_migration_s = "", 0.0  # recovered: migration may be tried again
        if state.action != "keep":
            state.windows = state.windows[-1:]  # the speeds changed: the fit starts from this window
            return made("restore", 1.0, f"the slowest rank is within {config.threshold:.0%} of the others: full width")
        return Decision(state.step, "keep", None, ratio, excess, move_bytes, move_s, 1.0, "no straggler")
    if config.mode == "off":
        return Decision(state.step, "keep", straggler, ratio, excess, move_bytes, move_s, 1.0, "resize_tp mode=off")
    heavy = ratio >= config.heavy_ratio
    persistent = state.persistent + 1 >= config.persist_windows
    worth = move_s < excess
    step = max(times) if step_s is None else step_s
    if all(w == 1.0 for w in work):
        state.full_width_step_s = step  # nothing resized nor migrated: what doing nothing costs
    state.migration_windows = state.migration_windows + 1 if state.action == "migrate" else 0
    # judged on the windows right after it started, against the full-width step just before:
    # later, the machine's own drift would be read as the migration's fault
    slower = (state.action == "migrate" and state.before_migration_s and state.migration_windows <= config.persist_windows
              and step > state.before_migration_s * (1 + MIGRATION_MARGIN))
    state.slower_windows = state.slower_windows + 1 if slower else 0
    if config.mode == "semi" and slower and state.slower_windows >= config.persist_windows:  # one slow window may be the machine's
        state.migration_failed = (
            f"migration measured slower: a step took {step * 1e3:.1f} ms with it ({state.slower_windows} windows in a row), "
            f"against {state.before_migration_s * 1e3:.1f} ms at full width without it"
        )
    if config.mode == "migrate" or (config.mode == "semi" and heavy and persistent and worth and not state.migration_failed):
        if config.mode == "migrate":
            return made("migrate", migrate_fraction, "mode=migrate")
        if state.action != "migrate":
            state.before_migration_s = state.full_width_step_s or max(speed)
        why = f"heavy (ratio >= {config.heavy_ratio}) and persistent ({state.persistent + 1} windows), and moving costs less than the excess"
        if config.migrate == "units":
            return _units_decision(made, why, config, migrate_fraction, needed, statistics.median(others), per_shard_others, fits[straggler],
                                   unit_share)
        if keep_after < 1.0 and needed > migrate_fraction and config.migrate != "units":
            why += f"; migrating {migrate_fraction:.0%} of its row-parallel columns cannot balance the ranks, so it keeps {keep_after:.0%} too"
            return made("migrate", migrate_fraction, why, keep_after)
        if needed > migrate_fraction:
            why += (f"; {migrate_fraction:.0%} of its units (max_migrate) cannot quite balance the ranks (needs {needed:.0%}); "
                    "not resized on top: lossless only")
        return made("migrate", migrate_fraction, why)
    why = "mode=resize" if config.mode == "resize" else (
        "light" if not heavy else "transient" if not persistent else state.migration_failed or "moving would cost more than the excess"
    )
    what = "units" if config.migrate == "units" else "columns"  # what resizing drops (resize/)
    return made("resize", keep_fraction, f"{why}: keep {keep_fraction:.0%} of its {what}")


def _units_decision(made, why: str, config: SemiConfig, migrate_fraction: float, needed: float, others_s: float,
                    per_shard_others: float, straggler_fit: tuple[float, float], unit_share: float = 0.0) -> Decision:
    """Heavy, persistent slowness under unit migration. Migration is lossless but bounded: a
    rank at half speed balanced with a healthy one leaves both at 4/3 of a healthy step, and
    the healthy rank pays for it. Where the balanced step would be over (1 + tolerance) x the
    others' time T, the others take only what fits in that budget, m = tolerance T / b_o, and
    the straggler keeps k of the rest, a_s + b_s (1 - m) k = (1 + tolerance) T (resizing by
    units, lossy, never below min_fraction): less is dropped than by resizing alone."""
    target = (1 + config.tolerance) * others_s
    balanced = others_s + per_shard_others * migrate_fraction
    if balanced <= target * (1 + 1e-9) and needed <= migrate_fraction:
        return made("migrate", migrate_fraction, why)
    fixed, per_shard = straggler_fit
    moved = moved_budget = min(config.max_migrate, migrate_fraction, max(0.0, (target - others_s) / max(per_shard_others, 1e-12)))
    rounded_away = 0.0 < moved < unit_share  # less than one unit of any block: nothing would move
    moved = 0.0 if rounded_away else moved
    keep = min(1.0, max(config.min_fraction, (target - fixed) / max(per_shard * (1 - moved), 1e-12)))
    if keep >= 1.0:
        return made("migrate", moved, why + f"; {migrate_fraction:.0%} of its units cannot balance the ranks (needs {needed:.0%})")
    budget = (f"balanced by migration alone a step would take {balanced * 1e3:.1f} ms, over (1 + tolerance {config.tolerance:g}) x the others' "
              f"{others_s * 1e3:.1f} ms: the others take {moved:.0%} of its units and it keeps {keep:.0%} of the rest"
              + (f" ({moved_budget:.0%} would be under one unit of any block)" if rounded_away else ""))
    if moved <= 0.0:
        return made("resize", keep, f"{why}; {budget}")
    return made("migrate", moved, f"{why}; {budget}", keep)


class SemiController:
    """Times this rank's compute every step, all-gathers the times over the tp group, runs
    `decide` every `window` steps and applies the decision to this rank's `Resizer`.

    A step runs from `begin_step` (the forward starts) to `end_step` (its backward ends);
    its compute time is the wall time less the time spent waiting on communication.
    `adjust(step, seconds)`, when set, changes the measured time before it is shared (tests
    inject noise; benchmarks could inject slowness)."""

    def __init__(self, resizer: Resizer, scheduler, config: SemiConfig, *, bandwidth: float, element_size: int, group: str = "tp", log: bool = True):
        self.resizer = resizer
        self.scheduler = scheduler
        self.config = config
        self.group = group
        self.bandwidth = bandwidth
        self.element_size = element_size
        self.log = log
        self.state = SemiState()
        self.decisions: list[Decision] = []
        self.errors: list[float] = []  # resizing error of every step (0 when nothing is dropped)
        self.adjust = None
        self.units = config.migrate == "units" and bool(resizer.units)  # unit migration (else columns)
        self.migratable = 1.0 if self.units else migratable_share(resizer)
        # unit_counts rounds per block: below this fraction no block moves a unit
        self.unit_share = 0.5 / max(block.units for block in resizer.units.values()) if self.units else 0.0
        self.enabled = True  # False: steps are not timed nor decided on (a bench's compute-only steps, where collectives are local)
        self._start: tuple[float, float] | None = None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose state moves with migrated units (else they restart theirs)."""
        self.resizer.optimizer = optimizer

    def begin_step(self) -> None:
        if self._start is None and self.enabled:
            self.resizer.apply_pending()  # a unit migration decided last step moves now (collective)
            self._start = (time.perf_counter(), self.scheduler.blocked_s)

    def my_work(self) -> float:
        """This rank's tp work this step, 1 for a plain shard (what its time is divided by)."""
        me = self.resizer.tp_rank
        share = self.resizer.fraction
        migration = self.resizer.migration
        units = self.resizer.unit_migration
        if self.units:  # dropped units and given ones are disjoint shares of the shard
            share = self.resizer.kept_share()
            moved = self.resizer.moved_share(units["counts"]) if units else 0.0
            return share - moved if units and me == units["giver"] else share + moved if units and me == units["taker"] else share
        if migration:
            moved = self.migratable * migration["fraction"]
            share = share * (1 - moved) if me == migration["giver"] else share + moved if me == migration["taker"] else share
        return share

    def end_step(self) -> Decision | None:
        """Called on every rank of the group once its backward is done (it all-reduces)."""
        if self._start is None:
            return None
        started, blocked = self._start
        self._start = None
        wall_s = time.perf_counter() - started
        compute_s = wall_s - (self.scheduler.blocked_s - blocked)
        if self.adjust is not None:
            compute_s = wall_s = self.adjust(self.state.step, compute_s)  # an injected time stands for the whole step
        self.errors.append(self.resizer.error())
        times, work, walls = self.gather(compute_s, self.my_work(), wall_s)
        self.state.step += 1
        self.state.samples.append(times)
        self.state.work.append(work)
        self.state.step_walls.append(max(walls))
        if self.state.step % self.config.window:
            return None
        window, shares = self.state.samples[-self.config.window :], self.state.work[-self.config.window :]
        # the median step: one outlier (the first step lowers the graph) does not move it
        window_times = [statistics.median(step[r] for step in window) for r in range(len(times))]
        mean_work = [statistics.fmean(step[r] for step in shares) for r in range(len(times))]
        step_s = statistics.median(self.state.step_walls[-self.config.window :])
        decision = decide(window_times, mean_work, self.state, self.config, self._bytes_per_fraction(), self.bandwidth, self.migratable, step_s,
                          self.unit_share)
        self.apply(decision)
        self.decisions.append(decision)
        if self.log and decision.action != "keep" and self.resizer.tp_rank == 0:
            print(f"commfx: resize_tp (rank {self.scheduler.rank}, tp group): {decision.line()}", file=sys.stderr, flush=True)
        return decision

    def gather(self, compute_s: float, work: float, wall_s: float) -> tuple[list[float], list[float], list[float]]:
        """Every rank's (compute time, work, wall time), the same lists on every rank: each rank
        writes its slots of a zero vector and the group sums them (one small all-reduce, exact)."""
        size = self.resizer.tp_size
        slots = torch.zeros(3 * size, dtype=torch.float64)
        for i, value in enumerate((compute_s, work, wall_s)):
            slots[i * size + self.resizer.tp_rank] = value
        summed = self.scheduler.all_reduce(slots, self.group, kind="tp_timings").tolist()
        return summed[:size], summed[size : 2 * size], summed[2 * size :]

    def apply(self, decision: Decision) -> None:
        me = self.resizer.tp_rank
        if decision.action == "restore":
            self.resizer.restore()
        elif decision.action == "resize":
            self.resizer.migrate(0, 0, 0.0)
            if self.resizer.unit_migration is not None:
                self.resizer.request_units(0, 0, {})
            if self.units:  # whole units: the straggler computes on views of the ones it keeps
                self.resizer.request_unit_resize(decision.fraction if me == decision.straggler else 1.0)
            else:
                self.resizer.resize(decision.fraction if me == decision.straggler else 1.0)
        elif decision.action == "migrate":
            if self.units:
                self.resizer.request_unit_resize(decision.keep if me == decision.straggler else 1.0)
            else:
                self.resizer.resize(decision.keep if me == decision.straggler else 1.0)
            times = self.state.samples[-1]
            taker = min((r for r in range(len(times)) if r != decision.straggler), key=lambda r: (times[r], r))
            if self.units:
                counts = self.resizer.unit_counts(decision.fraction)
                current = self.resizer.pending or self.resizer.unit_migration
                if current and current["counts"] and current["giver"] == decision.straggler and (
                    abs(self.resizer.moved_share(counts) - self.resizer.moved_share(current["counts"])) < UNIT_HYSTERESIS
                ):
                    taker, counts = current["taker"], current["counts"]  # close enough: moving again would cost more
                self.resizer.request_units(decision.straggler, taker, counts)
                size = sum(self.resizer.params[name].element_size() * self.resizer.units[key].index(layout, 0, n).numel()
                           * (self.resizer.params[name].numel() // self.resizer.params[name].shape[dim])
                           for key, n in counts.items() for name, dim, layout in self.resizer.units[key].tensors)
                decision.detail = (f"units to rank {taker}: " + ", ".join(f"{n}/{self.resizer.units[k].units} "
                                   f"of {k.rsplit('.', 1)[0]}" for k, n in counts.items())
                                   + f" ({self.resizer.moved_share(counts):.0%} of its work; {size:,} B of weights moved once, with their optimizer state)")
            else:
                self.resizer.migrate(decision.straggler, taker, decision.fraction)

    def _bytes_per_fraction(self) -> float:
        """Bytes per step that migrating a whole shard's row-parallel columns would move (unit
        migration moves nothing per step)."""
        if self.units:
            return 0.0
        total = 0
        for key, (weight, kind) in self.resizer.linears.items():
            if kind == "row":
                plan = self.resizer.plan(key)
                total += 2 * plan.width * (weight.shape[0] + max(plan.rows, 1)) * self.element_size
        return float(total)

    def state_dict(self) -> dict:
        return {"resizer": self.resizer.state_dict(), "semi": dataclasses.asdict(self.state), "decisions": [dataclasses.asdict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict) -> None:
        self.resizer.load_state_dict(state["resizer"])
        self.state = SemiState(**state["semi"])
        self.decisions = [Decision(**d) for d in state["decisions"]]


def migratable_share(resizer: Resizer) -> float:
    """The share of a rank's tp multiply-adds in row-parallel linears (what migration can move):
    each linear does weight.numel() multiply-adds per row."""
    total = sum(weight.numel() for weight, _ in resizer.linears.values())
    rows = sum(weight.numel() for weight, kind in resizer.linears.values() if kind == "row")
    return rows / total if total else 1.0


def make_controller(module: torch.nn.Module, spec: dict, scheduler, topology: Topology, tp_rank: int) -> SemiController:
    """The controller for a module the resize_tp pass rewrote (`spec`: its annotation)."""
    linears = {key: (module.get_parameter(key), info["kind"]) for key, info in spec["linears"].items()}
    units, params = {}, {}
    for key, unit in (spec.get("units") or {}).items():
        units[key] = UnitBlock(key, unit["graph"], unit["kinds"], [tuple(t) for t in unit["tensors"]], unit["per_rank"], unit["unit"])
        params.update({name: module.get_parameter(name) for name, _dim, _layout in unit["tensors"]})
    resizer = Resizer(linears, scheduler.op_state, tp_rank, topology.tp, units=units, params=params, scheduler=scheduler)
    options = spec["options"]
    config = SemiConfig(**{f.name: options[f.name] for f in dataclasses.fields(SemiConfig) if f.name in options})
    if not units:
        config = dataclasses.replace(config, migrate="columns")  # no block cuts into units: column migration
    group = topology.process_groups()["tp"]
    mine = next(g for g in group if scheduler.rank in g)
    across_nodes = len({topology.node_of(r) for r in mine}) > 1
    bandwidth = topology.inter_node_bandwidth if across_nodes else topology.intra_node_bandwidth
    element_size = next(iter(linears.values()))[0].element_size() if linears else 4
    return SemiController(resizer, scheduler, config, bandwidth=bandwidth, element_size=element_size)
