"""Straggler emulation for `commfx bench --slow-rank R:FACTOR`: rank R computes FACTOR times slower.

Two ways, and the bench output says which one ran:

- **cgroup** (Linux, root, cgroup v1 `cpu` or v2 with the cpu controller): the slow rank
  runs its slowed plans inside a cgroup whose CPU quota is 1/FACTOR of a core (ranks run
  one compute thread each). Everything it does slows down, optimizer and communication
  threads included, as on a throttled node. The quota is a ceiling: on a machine whose
  cores are already contended the rank may be slowed by less than FACTOR.
- **delay**: every compute node of the slow rank's graphs takes FACTOR times as long (the
  executor sleeps (FACTOR - 1) x the node's own time, paid in slices of a millisecond or
  more and before each collective; see `runtime/executor.py`). Calibrated against the
  work itself, so a resized linear waits less and shared cores do not change the ratio;
  code outside the graphs (the optimizer step) is not slowed.

`auto` takes the cgroup where it can be made and the delays elsewhere. The parent makes
the cgroup before ranks start (`prepare`) and removes it after (`cleanup`); each rank
applies the slowness around the rounds of the plans it slows (`RankSlowdown`), so one
interleaved run can hold a healthy reference plan beside slowed ones.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

METHODS = ("auto", "cgroup", "delay")
PERIOD_US = 10_000  # short CFS periods: the throttling is spread over a step, not one 100 ms stall
MAX_FACTOR = 100.0
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")


def parse_slow_rank(text: str) -> tuple[int, float]:
    """`R:FACTOR` -> (rank, factor): rank R computes FACTOR (> 1) times slower; 1:2 is half speed."""
    rank, sep, factor = text.partition(":")
    try:
        parsed = (int(rank), float(factor)) if sep else None
    except ValueError:
        parsed = None
    if parsed is None or parsed[0] < 0 or not 1.0 < parsed[1] <= MAX_FACTOR:
        raise ValueError(
            f"--slow-rank {text!r} must be RANK:FACTOR with a rank >= 0 and 1 < FACTOR <= {MAX_FACTOR:g} "
            "(how many times slower that rank computes), e.g. --slow-rank 1:2 for rank 1 at half speed"
        )
    return parsed


@dataclass(frozen=True)
class SlowRank:
    """What the ranks need to know: who is slow, by how much, and how it is done."""

    rank: int
    factor: float
    method: str  # "cgroup" | "delay"
    cgroup: str = ""  # the cgroup directory (method "cgroup")
    note: str = ""  # why "auto" fell back to delays
    host_pid: int = 0  # the process that made the cgroup: ranks in a network namespace see /sys through it

    def describe(self) -> str:
        if self.method == "cgroup":
            how = f"CPU quota of {1 / self.factor:.2f} core, cgroup {self.cgroup}"
        else:
            how = "per-op delays in the graph executor (each compute node takes FACTOR x its own time)"
            if self.note:
                how += f"; no cgroup: {self.note}"
        return f"straggler: rank {self.rank} computes {self.factor:g}x slower, by {how}"

    def as_dict(self) -> dict:
        return {"rank": self.rank, "factor": self.factor, "method": self.method, "cgroup": self.cgroup,
                "note": self.note, "describe": self.describe()}


def cgroup_problem() -> str:
    """Why a CPU-quota cgroup cannot be made here ("" when it can)."""
    if os.name != "posix" or not Path("/sys/fs/cgroup").is_dir():
        return "no /sys/fs/cgroup (not Linux?)"
    if os.geteuid() != 0:
        return "not root (cgroups need root)"
    if (_V1 / "cpu.cfs_quota_us").exists():
        return "" if os.access(_V1, os.W_OK) else f"{_V1} is not writable"
    controllers = _V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "" if os.access(_V2, os.W_OK) else f"{_V2} is not writable"
    return "no cgroup cpu controller (neither v1 cpu.cfs_quota_us nor v2 cpu)"


def check_request(rank: int, factor: float, world_size: int, method: str = "auto") -> None:
    """A bad request is an error before any rank starts, not a hang later."""
    if method not in METHODS:
        raise ValueError(f"--slow-method must be one of {', '.join(METHODS)}, got {method!r}")
    if not 1.0 < factor <= MAX_FACTOR:
        raise ValueError(f"--slow-rank {rank}:{factor:g}: FACTOR must be in (1, {MAX_FACTOR:g}], e.g. 2 for half speed")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"--slow-rank {rank}:{factor:g} names rank {rank}, but the cluster has {world_size} ranks "
            f"(0..{world_size - 1}); pick one of them"
        )
    if method == "cgroup" and cgroup_problem():
        raise ValueError(f"--slow-method cgroup: {cgroup_problem()}; use --slow-method delay (per-op delays) instead")


def prepare(rank: int, factor: float, world_size: int, method: str = "auto") -> SlowRank:
    """Check the request and make the cgroup if one is used (parent side, before ranks start)."""
    check_request(rank, factor, world_size, method)
    problem = cgroup_problem() if method != "delay" else "--slow-method delay"
    if problem:
        return SlowRank(rank, factor, "delay", note=problem if method == "auto" else "")
    try:
        return SlowRank(rank, factor, "cgroup", cgroup=str(_make_cgroup(rank, factor)), host_pid=os.getpid())
    except OSError as error:
        if method == "cgroup":
            raise ValueError(f"--slow-method cgroup: could not make a cgroup ({error}); use --slow-method delay") from None
        return SlowRank(rank, factor, "delay", note=f"could not make a cgroup ({error})")


def _make_cgroup(rank: int, factor: float) -> Path:
    quota = max(1000, int(PERIOD_US / factor))  # the kernel's minimum quota is 1 ms
    if (_V1 / "cpu.cfs_quota_us").exists():
        group = _V1 / f"commfx-slow-{os.getpid()}-{rank}"
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (_V2 / "cgroup.subtree_control").write_text("+cpu")
        group = _V2 / f"commfx-slow-{os.getpid()}-{rank}"
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    return group


def cleanup(slow: SlowRank | None) -> None:
    """Remove the cgroup once its rank has exited (an empty cgroup can be removed)."""
    if slow is not None and slow.cgroup:
        try:
            os.rmdir(slow.cgroup)
        except OSError:
            pass


def _own_cgroup(root: Path, v1: bool) -> Path:
    """This process's current cpu cgroup directory under `root` (to come back to)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "cpu" in controllers.split(",")) or (not v1 and controllers == ""):
            return root / path.lstrip("/")
    return root


def _visible(path: Path, host_pid: int) -> Path:
    """`path` as this process can reach it: `ip netns exec` mounts a fresh /sys without the
    cgroup hierarchy, so a rank in a namespace goes through the parent's root."""
    if path.exists():
        return path
    via = Path(f"/proc/{host_pid}/root") / path.relative_to("/")
    if host_pid and via.exists():
        return via
    raise RuntimeError(f"this rank cannot see the straggler's cgroup {path} (nor through /proc/{host_pid}/root); "
                       "use --slow-method delay")


class RankSlowdown:
    """The rank side: slow this rank (if it is the slow one) while a slowed plan runs."""

    def __init__(self, slow: SlowRank | None, rank: int):
        self.slow = slow if slow is not None and slow.rank == rank else None
        self._group = self._home = None
        if self.slow is not None and self.slow.method == "cgroup":
            self._group = _visible(Path(self.slow.cgroup), self.slow.host_pid)
            self._home = _own_cgroup(self._group.parent, v1=self.slow.cgroup.startswith(str(_V1)))

    @contextmanager
    def applied(self, scheduler, active: bool = True):
        """Within the block this rank is slow (no-op for other ranks and healthy plans)."""
        if self.slow is None or not active:
            yield
            return
        if self.slow.method == "cgroup":
            _move(self._group)
        else:
            scheduler.slowdown = self.slow.factor
        try:
            yield
        finally:
            if self.slow.method == "cgroup":
                _move(self._home)
            else:
                scheduler.slowdown, scheduler.slow_debt_s = 1.0, 0.0


def _move(group: Path) -> None:
    """Move this whole process (every thread) into `group`."""
    (group / "cgroup.procs").write_text(str(os.getpid()))
