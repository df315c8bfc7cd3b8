"""The launcher owns its ranks: a signal to the CLI, or the CLI's death, leaves no rank
running and (for the signals it can catch) no job directory behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commfx.runtime.launcher import STOP_SIGNALS

pytestmark = pytest.mark.distributed


def ranks_of(job_root: Path) -> list[int]:
    """PIDs of live processes whose command line names a job directory under `job_root`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(l for l in (proc / "status").read_text().splitlines() if l.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if str(job_root) in cmdline and "commfx.runtime.worker" in cmdline and "zombie" not in state:
            pids.append(int(proc.name))
    return pids


def start_cli(job_root: Path, *, ignore: tuple[int, ...] = ()) -> subprocess.Popen:
    """`commfx run` on a tiny model for (nearly) ever. Signal dispositions start at their
    defaults whatever pytest's own were (a background shell job ignores SIGINT), except
    those in `ignore`, as `nohup` would leave them."""
    env = {**os.environ, "TMPDIR": str(job_root), "PYTHONWARNINGS": "ignore"}
    command = ["-m", "commfx", "run", "gpt-moe-tiny", "--world-size", "2", "--steps", "100000"]

    def dispositions() -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN if s in ignore else signal.SIG_DFL)

    return subprocess.Popen(
        [sys.executable, *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=dispositions,
    )


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def wait_for_ranks(cli: subprocess.Popen, job_root: Path) -> None:
    assert wait_until(lambda: len(ranks_of(job_root)) == 2 or cli.poll() is not None, 60), "ranks never started"
    assert cli.poll() is None, cli.stdout.read()


def assert_nothing_left(job_root: Path) -> None:
    assert wait_until(lambda: not ranks_of(job_root), 10), f"ranks left running: {ranks_of(job_root)}"
    assert not list(job_root.glob("commfx-job-*")), "job directory left behind"


@pytest.mark.parametrize("signum, times", [(signal.SIGTERM, 1), (signal.SIGINT, 2), (signal.SIGHUP, 1)])
def test_a_signal_to_the_cli_stops_every_rank_and_removes_the_job(tmp_path, signum, times):
    """`times=2`: Ctrl-C pressed twice must not cut the clean-up short."""
    cli = start_cli(tmp_path)
    try:
        wait_for_ranks(cli, tmp_path)
        time.sleep(random.Random(int(signum)).uniform(0.2, 4.0))  # somewhere in the run: startup, capture, compile or steps
        for _ in range(times):
            cli.send_signal(signum)
            time.sleep(0.05)
        assert cli.wait(timeout=60) == 128 + signum
        out = cli.stdout.read()
        assert f"stopped by {signal.Signals(signum).name}: every rank was stopped and the job directory removed" in out, out
        assert_nothing_left(tmp_path)
    finally:
        cli.kill()
        for pid in ranks_of(tmp_path):
            os.kill(pid, signal.SIGKILL)


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(l for l in status.splitlines() if l.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (signum - 1) & 1)


def test_a_signal_while_the_cli_compiles_before_any_rank_ends_cleanly(tmp_path):
    """The CLI compiles rank 0's share itself before launching: a signal then ends it as cleanly.
    SIGTERM has no handler until the CLI's main() installs one, which is the moment to send it."""
    cli = start_cli(tmp_path)
    try:
        assert wait_until(lambda: catches(cli.pid, signal.SIGTERM) or cli.poll() is not None, 60)
        assert not ranks_of(tmp_path)
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 128 + signal.SIGTERM
        out = cli.stdout.read()
        assert "stopped by SIGTERM: no rank had started" in out and "Traceback" not in out, out
        assert_nothing_left(tmp_path)
    finally:
        cli.kill()


def test_a_signal_the_caller_ignores_stays_ignored(tmp_path):
    """Under `nohup`, SIGHUP (the terminal closing) must not stop the training."""
    cli = start_cli(tmp_path, ignore=(signal.SIGHUP,))
    try:
        wait_for_ranks(cli, tmp_path)
        cli.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert cli.poll() is None and len(ranks_of(tmp_path)) == 2, "SIGHUP stopped a run that ignores it"
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 128 + signal.SIGTERM
        assert_nothing_left(tmp_path)
    finally:
        cli.kill()
        for pid in ranks_of(tmp_path):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["as they start", "mid-run"])
def test_ranks_exit_when_the_launcher_is_killed(tmp_path, when):
    """`as they start`: ranks spend their first seconds importing torch, before any code of
    theirs runs; the kernel's parent-death signal is armed before that (between fork and exec)."""
    cli = start_cli(tmp_path)
    try:
        wait_for_ranks(cli, tmp_path)
        if when == "mid-run":
            time.sleep(random.Random(7).uniform(2.0, 5.0))
        cli.kill()  # SIGKILL: no handler runs, so the ranks must notice on their own
        cli.wait(timeout=10)
        assert wait_until(lambda: not ranks_of(tmp_path), 10), f"orphaned ranks: {ranks_of(tmp_path)}"
    finally:
        for pid in ranks_of(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_a_second_signal_after_the_stop_does_not_kill_the_cli_while_it_reports(tmp_path):
    """The race behind a rare CI failure (exit -2 instead of 130): the first Ctrl-C's clean-up
    finished, the handlers were restored, and the second Ctrl-C killed the CLI before it printed
    and returned. With exit_after_a_stop the handler stays and ignores it."""
    script = (
        "import os, signal\n"
        "from commfx.runtime.launcher import Stopped, stop_on_signals\n"
        "try:\n"
        "    with stop_on_signals(exit_after_a_stop={keep}):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "except Stopped:\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, after the clean-up\n"
        "    print('reported', flush=True)\n"
        "    raise SystemExit(130)\n"
    )
    for keep, code in ((True, 130), (False, -signal.SIGINT)):
        done = subprocess.run(
            [sys.executable, "-c", script.format(keep=keep)], capture_output=True, text=True, timeout=60,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job has it (CI may ignore SIGINT)
        )
        assert done.returncode == code, (keep, done.returncode, done.stderr[-500:])
        assert ("reported" in done.stdout) == keep


def test_a_second_signal_during_the_interpreter_shutdown_does_not_kill_the_cli(tmp_path):
    """The same CI failure's other window: after main() returns 130, Python's shutdown resets
    every Python-level signal handler to the default action before it tears down modules
    (torch's take a while), so a second Ctrl-C then killed the process (-2). After a stop the
    handlers become SIG_IGN, which the shutdown leaves alone. A module global's finaliser
    marks the moment the handlers are gone; the signal is sent then."""
    marker = tmp_path / "tearing-down"
    script = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "from commfx.runtime.launcher import Stopped, stop_on_signals\n"
        "class SlowTeardown:\n"
        "    def __del__(self):\n"
        f"        Path({str(marker)!r}).write_text('now')\n"
        "        time.sleep(3)\n"
        "keep = SlowTeardown()\n"
        "try:\n"
        "    with stop_on_signals(exit_after_a_stop=True):\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "except Stopped as stop:\n"
        "    sys.exit(128 + stop.signum)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        assert wait_until(marker.exists, 60), "the child never reached its shutdown"
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        child.kill()
