"""A rank template: one process that has imported torch and commfx once and forks ranks.

A rank spends its first seconds importing torch, dynamo and commfx (about 3 s of CPU each
on this machine), and a launcher that starts ranks one job after another (a test suite, a
bench sweep) pays that for every rank of every job. The template pays it once: it is
started with a rank's environment, imports what `python -m commfx.runtime.worker` imports,
and on each request forks a child that becomes a rank (its own session, its log on stdout
and stderr, the job's environment, working directory and import path) and runs the worker.
This is how PyTorch's DataLoader starts its workers; as there, the template never computes,
so no OpenMP pool or CUDA context exists when it forks.

The template reaps its children and reports each exit on its stdout; `ForkedRank` gives
the launcher what it uses of `subprocess.Popen` (pid, poll, wait). It dies with its
launcher (the kernel's parent-death signal, and end of file on its stdin), and its ranks
die with it. `launcher.py` falls back to plain subprocesses where a fork cannot stand in
for a fresh process: a rank with its own argv prefix (`ip netns exec`) or environment,
rank 0's output streamed to the terminal, a GPU job, or COMMFX_RANK_TEMPLATE=0.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

READY_TIMEOUT_S = 180.0  # importing torch takes ten or more seconds on a busy machine
REPLY_TIMEOUT_S = 30.0


class TemplateUnavailable(RuntimeError):
    """The template could not start or stopped answering: start ranks as subprocesses."""


def die_with(launcher_pid: int) -> Callable[[], None] | None:
    """What a child runs between fork and exec: ask the kernel to SIGKILL it when the launcher
    dies (PR_SET_PDEATHSIG survives exec). Armed before the child's first import, because a
    rank or template spends seconds importing torch; a launcher killed then must not leave it
    behind. The worker's parent watch is the backstop."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: the child only calls it
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:  # the launcher died before the signal was armed
            os._exit(3)

    return arm


class ForkedRank:
    """A rank the template forked, seen from the launcher as `subprocess.Popen` is."""

    def __init__(self, pid: int, template: "RankTemplate"):
        self.pid, self._template = pid, template

    def poll(self) -> int | None:
        return self._template.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self._template.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return code


class RankTemplate:
    """The launcher's side of one template process, started with `environment`."""

    def __init__(self, environment: dict[str, str]):
        self.environment = environment
        self.owner = os.getpid()  # a process forked from the launcher must start its own template
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._changed = threading.Condition()
        self._request_lock = threading.Lock()
        self._alive = True
        self._process = subprocess.Popen(
            [sys.executable, "-m", "commfx.runtime.rank_template"],
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )
        if self._read_line(READY_TIMEOUT_S) != b"ready":
            self.close()
            raise TemplateUnavailable("the rank template did not finish its imports")
        threading.Thread(target=self._read_reports, name="commfx-rank-template", daemon=True).start()

    def start_rank(self, argv: list[str], environment: dict[str, str], log: Path, cwd: str) -> ForkedRank:
        """Fork a rank that runs the worker with `argv`, `environment` and its output in `log`."""
        request = {"argv": argv, "env": environment, "log": str(log), "cwd": cwd}
        with self._request_lock:
            if not self.alive:
                raise TemplateUnavailable("the rank template has stopped")
            with self._changed:
                known = len(self._started)
            try:
                self._process.stdin.write(json.dumps(request).encode() + b"\n")
                self._process.stdin.flush()
            except OSError as error:
                raise TemplateUnavailable(f"the rank template stopped taking requests ({error})") from error
            with self._changed:
                if not self._changed.wait_for(lambda: len(self._started) > known or not self._alive, REPLY_TIMEOUT_S) or len(self._started) == known:
                    raise TemplateUnavailable("the rank template did not fork the rank")
                return ForkedRank(self._started[known], self)

    @property
    def alive(self) -> bool:
        return self._alive and self._process.poll() is None

    def busy(self) -> bool:
        with self._changed:
            return any(pid not in self._exits for pid in self._started)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the template; its ranks die with it (their parent-death signal)."""
        self._alive = False
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def _read_line(self, timeout_s: float) -> bytes | None:
        ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
        return self._process.stdout.readline().strip() if ready else None

    def _read_reports(self) -> None:
        for line in self._process.stdout:
            kind, *fields = line.split()
            with self._changed:
                if kind == b"started":
                    self._started.append(int(fields[0]))
                elif kind == b"exit":
                    self._exits[int(fields[0])] = int(fields[1])
                self._changed.notify_all()
        with self._changed:  # the template is gone, and its ranks with it
            self._alive = False
            for pid in self._started:
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._changed.notify_all()


# ---- the template process -------------------------------------------------------------


def serve() -> None:
    """The template's main loop: fork a rank per request, report each rank's exit."""
    # Running this module imported the commfx package, and with it torch and dynamo: what a
    # rank's `python -m commfx.runtime.worker` imports before the worker itself runs.
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    _say(b"ready")
    pending = b""
    while True:
        try:
            readable, _, _ = select.select([0, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in readable:
            os.read(wake_read, 4096)
            _report_exits()
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:
                return  # the launcher is gone: the ranks' parent-death signal takes them
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    os.close(wake_read)
                    os.close(wake_write)
                    _become_rank(json.loads(line), base_path)
                _say(b"started %d" % pid)
        _report_exits()


def _say(line: bytes) -> None:
    os.write(1, line + b"\n")


def _report_exits() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(b"exit %d %d" % (pid, os.waitstatus_to_exitcode(status)))


def _become_rank(request: dict, base_path: list[str]) -> None:
    """In the forked child: take the rank's session, output, environment and path, run it."""
    code = 1
    try:
        template = os.getppid()
        os.setsid()
        die_with(template)()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = list(dict.fromkeys([request["cwd"], *python_path, *base_path]))
        sys.argv = [str(Path(__file__).with_name("worker.py")), *request["argv"]]
        # As `python -m commfx.runtime.worker` runs it: the worker is __main__ (its imports are warm).
        runpy.run_module("commfx.runtime.worker", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    serve()
