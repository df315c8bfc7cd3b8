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


def start_cli(job_root: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(job_root), "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, "-m", "commfx", "run", "gpt-moe-tiny", "--world-size", "2", "--steps", "100000"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_cli_stops_every_rank_and_removes_the_job(tmp_path, signum):
    cli = start_cli(tmp_path)
    try:
        wait_for_ranks(cli, tmp_path)
        time.sleep(random.Random(int(signum)).uniform(0.2, 4.0))  # somewhere in the run: capture, compile or steps
        cli.send_signal(signum)
        assert cli.wait(timeout=60) == 128 + signum
        out = cli.stdout.read()
        assert f"stopped by {signal.Signals(signum).name}" in out, out
        assert wait_until(lambda: not ranks_of(tmp_path), 10), f"ranks left running: {ranks_of(tmp_path)}"
        assert not list(tmp_path.glob("commfx-job-*")), "job directory left behind"
    finally:
        cli.kill()
        for pid in ranks_of(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    cli = start_cli(tmp_path)
    try:
        wait_for_ranks(cli, tmp_path)
        cli.kill()  # SIGKILL: no handler runs, so the ranks must notice on their own
        cli.wait(timeout=10)
        assert wait_until(lambda: not ranks_of(tmp_path), 10), f"orphaned ranks: {ranks_of(tmp_path)}"
    finally:
        for pid in ranks_of(tmp_path):
            os.kill(pid, signal.SIGKILL)
