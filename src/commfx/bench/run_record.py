"""What a measuring run records so that its figures can be judged later: the commit, the
command line, the machine (cores, load average at start and end, the share of CPU other
processes took while it ran) and the model's proportions preset (or "toy").

`commfx bench` and every script under benchmarks/ that writes JSON put
``RunRecorder.finish()`` under the key ``"run"``; `benchmarks/report.py` reads it back.
Stdlib only, so any script can import it without building a plan.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# A run taken above this load average per core is marked as loaded in the results page.
LOADED_PER_CORE = 1.5
TOY = "toy"


def git_commit(where: Path | None = None) -> dict:
    """HEAD of the repository holding this package (or `where`), and whether tracked files
    differ from it; None values where there is no git checkout."""
    where = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": head, "dirty": bool(dirty)}


def _busy_seconds() -> float | None:
    """Seconds all cores spent busy since boot (/proc/stat; None where it cannot be read)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and its waited-for children (the ranks it launched)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


@dataclass
class RunRecorder:
    """Started before a run, finished after it: `finish()` gives the record to store."""

    proportions: str = TOY
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    _start: float = field(default_factory=time.monotonic)
    _load_start: list[float] | None = field(default_factory=_loadavg)
    _busy_start: float | None = field(default_factory=_busy_seconds)
    _own_start: float = field(default_factory=_own_seconds)

    def finish(self) -> dict:
        """The record: commit, command, machine (with load and others' CPU share), proportions."""
        elapsed = time.monotonic() - self._start
        cores = os.cpu_count() or 1
        busy_end = _busy_seconds()
        others = None
        if busy_end is not None and self._busy_start is not None and elapsed > 0:
            theirs = (busy_end - self._busy_start) - (_own_seconds() - self._own_start)
            others = round(min(max(theirs / (elapsed * cores), 0.0), 1.0), 3)
        return {
            "commit": git_commit(),
            "command": _command(self.argv),
            "cwd": os.getcwd(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "seconds": round(elapsed, 1),
            "machine": {"cores": cores, "load_start": self._load_start, "load_end": _loadavg(),
                        "others_cpu_share": others},
            "proportions": self.proportions or TOY,
        }


def _command(argv: list[str]) -> str | None:
    """The command line as typed, an installed entry point by its name (`commfx bench ...`)."""
    if not argv:
        return None
    first = Path(argv[0])
    return shlex.join([first.name if first.is_absolute() else argv[0], *argv[1:]])


def loaded(load: list[float] | None, cores: int | None) -> bool | None:
    """Whether a 1-minute load average was above LOADED_PER_CORE per core (None: unknown)."""
    if not load or not cores:
        return None
    return load[0] / cores > LOADED_PER_CORE
