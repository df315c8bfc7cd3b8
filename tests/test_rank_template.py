"""Ranks forked from a rank template (runtime/rank_template.py) are the ranks a fresh
process would be, the template is reused while the environment stays the same, and
nothing it forked outlives a launcher that is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commfx.runtime import launcher
from commfx.runtime.launcher import launch

pytestmark = pytest.mark.distributed

TESTS = Path(__file__).parent


def test_forked_ranks_see_what_fresh_ranks_see_and_the_template_is_reused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = launch("template_workers:describe", 2, timeout_s=120)
    second = launch("template_workers:describe", 2, timeout_s=120)
    monkeypatch.setenv("COMMFX_RANK_TEMPLATE", "0")
    fresh = launch("template_workers:describe", 2, timeout_s=120)

    def seen(ranks):
        return [{k: v for k, v in r.items() if k not in ("pid", "parent")} for r in ranks]

    assert seen(first) == seen(second) == seen(fresh)
    assert [r["env_rank"] for r in first] == ["0", "1"] and first[0]["all_reduce"] == 3.0
    assert first[0]["cwd"] == str(tmp_path) and first[0]["threads"] == 1
    assert Path(first[0]["this_module_from"]).parent == TESTS
    templates = {r["parent"] for r in first + second}
    assert len(templates) == 1 and os.getpid() not in templates, "both jobs' ranks come from one template"
    assert {r["parent"] for r in fresh} == {os.getpid()}, "COMMFX_RANK_TEMPLATE=0 starts fresh processes"
    assert len({r["pid"] for r in first + second}) == 4


def test_a_changed_environment_gets_its_own_template(monkeypatch):
    """torch and commfx read environment variables when imported: a template started under
    another environment is not the process a fresh rank would be."""
    before = launch("template_workers:describe", 1, timeout_s=120)[0]
    monkeypatch.setenv("COMMFX_TEST_MARKER", "changed")
    after = launch("template_workers:describe", 1, timeout_s=120)[0]
    assert before["marker"] is None and after["marker"] == "changed"
    assert before["parent"] != after["parent"]
    assert len(launcher._TEMPLATES) <= launcher._TEMPLATES_KEPT


def _processes_under(job_root: Path) -> list[int]:
    """Live processes started with TMPDIR=job_root: the launcher's template and its ranks
    (a forked rank's /proc environ is the template's)."""
    marker = f"TMPDIR={job_root}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                if "zombie" not in (proc / "status").read_text():
                    pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_the_template_and_its_ranks_exit_when_the_launcher_is_killed(tmp_path):
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from commfx.runtime.launcher import launch\n"
        "launch('template_workers:sleep_forever', 2, timeout_s=600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_processes_under(tmp_path)) < 4 and time.monotonic() < deadline:  # driver, template, 2 ranks
            time.sleep(0.2)
        started = set(_processes_under(tmp_path))
        assert len(started) == 4, f"expected the driver, its template and two ranks, found {len(started)}"
        driver.kill()
        driver.wait(timeout=10)
        deadline = time.monotonic() + 10
        while set(_processes_under(tmp_path)) & started and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(_processes_under(tmp_path)) & started, "the template or a rank outlived the launcher"
    finally:
        for pid in _processes_under(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_a_process_forked_from_the_launcher_starts_its_own_template():
    """The parent's template answers the parent's reader thread, which a fork does not copy."""
    parent = launch("template_workers:describe", 1, timeout_s=120)[0]["parent"]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            started = time.monotonic()
            seen = launch("template_workers:describe", 1, timeout_s=120)[0]["parent"]
            code = 0 if seen not in (parent, os.getpid()) and time.monotonic() - started < 25 else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    try:
        result = os.read(read, 1)
    finally:
        os.waitpid(child, 0)
    assert result == b"\x00", "the forked launcher used its parent's template, or fell back to fresh ranks"
