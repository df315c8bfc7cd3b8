"""Launch a function on N local ranks, each its own process, all bounded in time.

Every rank is a subprocess (`python -m commfx.runtime.worker`), optionally prefixed (for
example `ip netns exec NODE` on the emulated cluster). The launcher watches them all: when
one rank fails, the others get a short grace period to notice (their collectives fail
once a peer's sockets close) and are then killed; when the deadline passes, all are
killed. Either way the caller gets an error naming the rank and the end of its log, never
a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .devices import check_device
from .rank_template import ForkedRank, RankTemplate, TemplateUnavailable, die_with
from .worker import PORT_TAKEN


class LaunchError(RuntimeError):
    """A rank failed, or the job ran past its time bound."""


class _PortTaken(Exception):
    """Rank 0 found MASTER_PORT taken (worker.PORT_TAKEN): start again on another port."""


PORT_ATTEMPTS = 3


class Stopped(BaseException):
    """The launcher was told to stop (SIGTERM, SIGINT or SIGHUP): its ranks are stopped and
    the job directory removed before this propagates. A BaseException, like KeyboardInterrupt,
    so nothing in between swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.ranks_stopped = 0  # how many ranks the launcher had started and then stopped
        super().__init__(f"stopped by {signal.Signals(signum).name}")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class RankEnvironment:
    """How to start one rank: an argv prefix and extra environment variables."""

    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(
    function: str,
    world_size: int,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    grace_s: float = 10.0,
    rank_environment: Callable[[int], RankEnvironment] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    stream_rank0: bool = False,
    device: str = "cpu",
) -> list[Any]:
    """Run `function` ("module:name", called as f(rank=, world_size=, **kwargs)) on every rank.

    `device` "cuda" joins the ranks over NCCL (and gloo for CPU tensors), one GPU each
    (see devices.py; refused here, before any rank starts, when the GPUs are too few).
    Returns each rank's return value, in rank order.
    """
    check_device(device, ranks_per_node=world_size)  # every local rank runs on this machine
    with stop_on_signals():
        job = Path(tempfile.mkdtemp(prefix="commfx-job-"))
        procs: list[subprocess.Popen | ForkedRank] = []
        try:
            (job / "job.pkl").write_bytes(
                pickle.dumps(
                    {"function": function, "kwargs": kwargs or {}, "world_size": world_size, "collective_timeout_s": collective_timeout_s, "device": device}
                )
            )
            # Every rank forked from a template, or every rank a fresh process (rank_template.py).
            forked = rank_environment is None and not stream_rank0 and device == "cpu"
            for attempt in range(1 if master_port else PORT_ATTEMPTS):
                port = master_port or free_port(master_addr if master_addr.startswith("127.") else "0.0.0.0")
                for rank in range(world_size):
                    procs.append(_start_rank(job, rank, world_size, master_addr, port, rank_environment, stream_rank0 and rank == 0, forked))
                try:
                    _watch(procs, job, timeout_s=timeout_s, grace_s=grace_s)
                    break
                except _PortTaken:
                    _kill_all(procs)
                    procs.clear()
            else:
                raise LaunchError(
                    f"rank 0 could not listen on port {port} of {master_addr}: another process holds it. "
                    + ("Pass another master port, or none to let commfx pick a free one." if master_port else f"{PORT_ATTEMPTS} free ports in a row were taken.")
                )
            return [pickle.loads((job / f"result_{rank}.pkl").read_bytes()) for rank in range(world_size)]
        except Stopped as stop:
            stop.ranks_stopped = len(procs)
            raise
        finally:
            with _uninterrupted(len(procs)):
                _kill_all(procs)  # those still running: none after a clean finish
                shutil.rmtree(job, ignore_errors=True)


class _RaiseStopped:
    """The handler `stop_on_signals` installs. Only the first signal raises: a second one
    (Ctrl-C pressed twice) must not cut short the clean-up the first one started. During
    `_uninterrupted` clean-up a signal is held and raised when it is done."""

    def __init__(self) -> None:
        self.stopping = False
        self.holding = 0
        self.held: int | None = None

    def __call__(self, signum: int, _frame) -> None:
        if self.stopping:
            return
        if self.holding:
            self.held = self.held or signum
            return
        self.stopping = True
        raise Stopped(signum)


@contextlib.contextmanager
def _uninterrupted(ranks: int):
    """Stopping ranks and removing the job directory run to their end; a stop signal that
    arrives meanwhile is raised afterwards (unless a stop is already under way)."""
    handler = next((h for h in map(signal.getsignal, STOP_SIGNALS) if isinstance(h, _RaiseStopped)), None)
    if handler is None:
        yield
        return
    handler.holding += 1
    try:
        yield
    finally:
        handler.holding -= 1
    if not handler.holding and handler.held and not handler.stopping:
        stop, handler.held, handler.stopping = Stopped(handler.held), None, True
        stop.ranks_stopped = ranks
        raise stop


@contextlib.contextmanager
def stop_on_signals(*, exit_after_a_stop: bool = False):
    """While this is open, SIGTERM/SIGINT/SIGHUP raise `Stopped` (so that ranks are killed and
    the job directory removed on the way out) instead of ending the process on the spot and
    orphaning its ranks. A signal the caller ignores stays ignored (`nohup` ignores SIGHUP, a
    shell's background job SIGINT). Only the main thread takes signals: elsewhere, and inside
    an outer `stop_on_signals`, this changes nothing. `exit_after_a_stop`: the caller ends the
    process after a `Stopped` (the CLI), so a second signal (Ctrl-C pressed twice) is ignored
    from then on: it would otherwise kill the process while it reports the stop, or during
    the interpreter's shutdown, which resets Python-level handlers to the default action."""
    current = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    if threading.current_thread() is not threading.main_thread() or any(isinstance(h, _RaiseStopped) for h in current.values()):
        yield
        return
    handler = _RaiseStopped()
    previous = {s: signal.signal(s, handler) for s, h in current.items() if h is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN if exit_after_a_stop and handler.stopping else h)


def _start_rank(job: Path, rank, world_size, master_addr, port, rank_environment, stream, forked) -> subprocess.Popen | ForkedRank:
    extra = rank_environment(rank) if rank_environment else RankEnvironment()
    env = dict(os.environ)
    src_root = str(Path(__file__).resolve().parents[2])
    extra_paths = [src_root, *[p for p in sys.path if p and Path(p).is_dir() and "site-packages" not in p and "lib/python" not in p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(extra_paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    env["OMP_NUM_THREADS"] = "1"
    template = _template_for(env) if forked else None
    env.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "COMMFX_LAUNCHER_PID": str(os.getpid()),  # the worker exits if this process dies
        }
    )
    env.update(extra.env)
    log_path = job / f"log_{rank}.txt"
    if template is not None:
        log_path.touch()
        try:
            return template.start_rank([str(job), str(rank)], env, log_path, os.getcwd())
        except TemplateUnavailable:
            _TEMPLATES.pop(_fingerprint(template.environment), None)
            template.close()
    argv = [*extra.prefix, sys.executable, "-m", "commfx.runtime.worker", str(job), str(rank)]
    with open(log_path, "wb") as log:  # the rank holds its own copy
        return subprocess.Popen(
            argv,
            env=env,
            stdout=None if stream else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )


# One rank template per environment it was started with: torch, dynamo and commfx read
# environment variables when they are imported, so a rank forked from a template started
# under another environment would not be the rank a fresh process is.
_TEMPLATES: dict[frozenset, RankTemplate] = {}
_TEMPLATES_KEPT = 2
_template_failed = False


def _fingerprint(env: dict[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k != "PYTHONPATH")


def _template_for(env: dict[str, str]) -> RankTemplate | None:
    """The template for ranks started with `env`, started on first use; None where ranks
    must be fresh processes (COMMFX_RANK_TEMPLATE=0, or a template failed to start here), or
    off the main thread (the kernel's parent-death signal follows the thread that forked)."""
    global _template_failed
    if env.get("COMMFX_RANK_TEMPLATE", "1") == "0" or _template_failed or threading.current_thread() is not threading.main_thread():
        return None
    if any(t.owner != os.getpid() for t in _TEMPLATES.values()):
        _TEMPLATES.clear()  # inherited through a fork: the parent's templates answer the parent
    key = _fingerprint(env)
    template = _TEMPLATES.get(key)
    if template is not None and template.alive:
        return template
    for old_key in [k for k, t in _TEMPLATES.items() if not t.alive or (len(_TEMPLATES) >= _TEMPLATES_KEPT and not t.busy())]:
        _TEMPLATES.pop(old_key).close()
    try:
        _TEMPLATES[key] = RankTemplate(env)
    except (TemplateUnavailable, OSError):
        _template_failed = True
        return None
    return _TEMPLATES[key]


def _watch(procs: list[subprocess.Popen | ForkedRank], job: Path, *, timeout_s: float, grace_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    failure_deadline = None
    killed: set[int] = set()
    while True:
        codes = [p.poll() for p in procs]
        if codes[0] == PORT_TAKEN:
            raise _PortTaken()
        if all(c is not None for c in codes):
            break
        if failure_deadline is None and any(code not in (None, 0) for code in codes):
            failure_deadline = time.monotonic() + grace_s
        now = time.monotonic()
        if failure_deadline is not None and now > failure_deadline:
            _dump_stacks(procs)
            killed = _kill_all(procs)
            break
        if now > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            _dump_stacks(procs)
            killed = _kill_all(procs)
            raise LaunchError(
                f"the job ran past its time bound of {timeout_s:.0f}s and was stopped; "
                f"ranks still running: {running}. What they were doing:\n"
                + "\n".join(f"--- rank {r} ---\n{_last_stack(job, r)}" for r in running)
            )
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        raise LaunchError(_failure_report(job, codes, killed))


# Why a rank failed, in the order `_failure_report` looks for the root cause.
OWN_CODE_RAISED, DIED, STOPPED_WHILE_PEERS_WAITED, COLLECTIVE_FAILED, STOPPED = range(5)


def _failure_kind(job: Path, rank: int, killed: set[int], peers_only_waited: bool) -> int:
    error = job / f"error_{rank}.txt"
    if error.exists():
        return COLLECTIVE_FAILED if _is_communication_failure(error.read_text(errors="replace")) else OWN_CODE_RAISED
    if rank in killed:
        return STOPPED_WHILE_PEERS_WAITED if peers_only_waited else STOPPED
    return DIED


def _failure_report(job: Path, codes: list[int], killed: set[int]) -> str:
    """Name the rank that failed first in cause, not in time (survivors of a dead peer fail
    too), show its error (or its stack), and the stacks of the ranks the launcher stopped.

    The cause is, in this order: a rank whose own code raised (not a communication failure);
    one that died by itself without a traceback (crashed, exited); when every error is a
    communication failure, a rank that was still running when its peers' collectives timed
    out (hung or slow: it never arrived), which the launcher then stopped; one whose
    collective failed; the lowest rank within each.
    """
    failed = [r for r, c in enumerate(codes) if c != 0]
    errors = [r for r in failed if (job / f"error_{r}.txt").exists()]
    peers_only_waited = bool(errors) and all(_is_communication_failure((job / f"error_{r}.txt").read_text(errors="replace")) for r in errors)
    kind = {r: _failure_kind(job, r, killed, peers_only_waited) for r in failed}
    first = min(failed, key=lambda r: (kind[r], r))
    waited = [r for r in failed if kind[r] == COLLECTIVE_FAILED]
    others = [r for r in failed if r != first]
    if kind[first] == STOPPED_WHILE_PEERS_WAITED:
        hung = sorted(r for r in failed if kind[r] == STOPPED_WHILE_PEERS_WAITED)
        return (
            f"rank {first} did not arrive: {_ranks(waited)} waited for it in a collective until the time bound "
            f"(Plan.collective_timeout_s, --collective-timeout); the launcher then stopped {_ranks(hung)}, still running. "
            "Where each was:"
            + "".join(f"\n--- rank {r}, stopped by the launcher, was at ---\n{_last_stack(job, r, lines=6)}" for r in hung)
            + f"\n--- rank {waited[0]}, which waited ---\n{_rank_error(job, waited[0])}"
        )
    how = {OWN_CODE_RAISED: "its code raised", COLLECTIVE_FAILED: "its collective failed"}.get(kind[first])
    if how is None:
        how = f"killed by signal {-codes[first]}" if codes[first] < 0 else f"exit code {codes[first]}"
    return (
        f"rank {first} failed ({how})"
        + (f"; ranks {others} stopped after it" if others else "")
        + f".\n--- rank {first} ---\n{_rank_error(job, first)}"
        + "".join(f"\n--- rank {r}, stopped by the launcher, was at ---\n{_last_stack(job, r, lines=6)}" for r in sorted(killed))
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _rank_error(job: Path, rank: int, lines: int = 15) -> str:
    """The raising frame and exception of a rank (its log's tail when it left no traceback)."""
    error = job / f"error_{rank}.txt"
    text = error.read_text(errors="replace") if error.exists() else (job / f"log_{rank}.txt").read_text(errors="replace")
    return error_summary(text, lines) or "(nothing in its log)"


# What a rank says when a peer vanished under one of its collectives (commfx's own errors,
# gloo's transport, c10d's wrappers): the consequence of another rank's failure, not a cause.
_PEER_FAILURE_MARKERS = (
    "CommError",
    "DistBackendError",
    "DistNetworkError",
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport",
    "Broken pipe",
    "stopped with it",  # a shared failure (checkpoint.agree) raised on a rank that did not fail itself
)


def _is_communication_failure(traceback_text: str) -> bool:
    summary = error_summary(traceback_text)
    return any(marker in summary for marker in _PEER_FAILURE_MARKERS)


def _dump_stacks(procs: list[subprocess.Popen | ForkedRank], wait_s: float = 1.0) -> None:
    """Ask every running rank for its threads' stacks (the worker's faulthandler writes
    them to its log on SIGUSR1)."""
    asked = False
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked = True
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(wait_s)


def _last_stack(job: Path, rank: int, lines: int = 12) -> str:
    """The main thread's stack from the rank's last faulthandler dump (innermost call first)."""
    text = (job / f"log_{rank}.txt").read_text(errors="replace")
    block = _main_thread_block(text)
    if block is None:
        return error_summary(text, lines) or "(no stack: the rank did not answer)"
    frames = [line.strip() for line in block[1:] if line.strip().startswith("File ")]
    user = [f for f in frames if "/site-packages/" not in f and "/lib/python" not in f]
    shown = frames[:lines]
    where = f"\n(innermost frame of its own code: {user[0]})" if user and user[0] not in shown[:3] else ""
    return block[0] + "\n  " + "\n  ".join(shown) + where


_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", re.MULTILINE)


def _main_thread_block(text: str) -> list[str] | None:
    """The main thread's header and frames from the log's last faulthandler dump. The
    signal lands on any of the rank's threads (faulthandler calls that one "Current
    thread"), so the main thread is found by its outermost frame, which runs a module."""
    headers = [m.start() for m in _THREAD_HEADER.finditer(text)]
    for start, end in reversed(list(zip(headers, [*headers[1:], len(text)]))):
        block = text[start:end].strip().split("\n\n")[0].splitlines()
        if block[-1].strip().endswith(" in <module>") or any("<frozen runpy>" in line for line in block):
            return block
    return None


def _kill_all(procs: list[subprocess.Popen | ForkedRank]) -> set[int]:
    """SIGKILL every rank still running (its whole process group); returns their ranks."""
    killed = set()
    for rank, p in enumerate(procs):
        if p.poll() is None:
            killed.add(rank)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return killed


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Exit|Interrupt)\b[^\n]*")


def error_summary(text: str, lines: int = 15) -> str:
    """The raising frame and the first lines of the exception of a traceback; a message
    with a long tail (dynamo appends whole graphs) otherwise hides what went wrong."""
    all_lines = text.strip().splitlines()
    starts = [i for i, line in enumerate(all_lines) if _EXCEPTION_LINE.match(line)]
    if not starts:
        return "\n".join(all_lines[-lines:])
    start = starts[-1]
    # A chained traceback ("The above exception was the direct cause...") names its cause first.
    frames = [i for i in range(start) if all_lines[i].lstrip().startswith("File ")]
    frame = all_lines[frames[-1] : frames[-1] + 2] if frames else []
    message = [line for line in all_lines[start : start + lines] if not line.startswith(_NOISE)]
    return "\n".join([*frame, *message])


# Lines torch's interpreter appends to every error it re-raises, telling nothing here.
_NOISE = ("Original traceback:", "None", "Use tlparse to see full graph")
