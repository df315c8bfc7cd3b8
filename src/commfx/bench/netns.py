"""The network namespaces of emulated clusters: the names they take, the bounded ``ip`` and
``tc`` commands that make and remove them, and the clean-up of namespaces whose run died.

Names are ``cfx<pid>x<k>-(hub|n<i>)`` (``<pid>`` the process that made them), so
:func:`cleanup_stale` can tell a dead run's namespaces from a live one's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

__all__ = ["ClusterError", "cleanup_stale", "delete_namespaces", "list_run_namespaces", "namespace_problem", "run_command"]

NAME_PREFIX = "cfx"
SUBNET = "10.231"  # 10.231.<node>.0/24, only ever used inside our namespaces
ETC_NETNS = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
CMD_TIMEOUT_S = 20.0  # bound for every `ip` / `tc` call
_NS_RE = re.compile(rf"^{NAME_PREFIX}(\d+)x(\d+)-(hub|n\d+)$")


class ClusterError(RuntimeError):
    """A setup command failed."""


def run_command(argv: list[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run one setup/teardown command, bounded in time (tests replace the cluster's
    reference to it to make a command fail)."""
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False,
            start_new_session=True,  # a second Ctrl-C must not kill a cleanup command half-way
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"timed out after {timeout}s: {' '.join(argv)}") from e
    except OSError as e:
        raise ClusterError(f"cannot run {' '.join(argv)}: {e}") from e
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (rc={proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ip_netns_names() -> list[str]:
    if not shutil.which("ip"):
        return []
    try:
        out = run_command(["ip", "netns", "list"], check=False).stdout
    except ClusterError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_run_namespaces() -> list[str]:
    """Names of all network namespaces that look like ours (``cfx<pid>x<k>-...``),
    plus names that only have a leftover ``/etc/netns/<name>`` directory."""
    names = _ip_netns_names()
    try:
        names += [n for n in os.listdir(ETC_NETNS) if n not in names]
    except OSError:
        pass
    return [n for n in names if _NS_RE.match(n)]


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL processes still inside one of *our* namespaces (orphaned ranks, delay line)."""
    try:
        out = run_command(["ip", "netns", "pids", ns], check=False, timeout=5).stdout
    except ClusterError:
        return
    for tok in out.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def delete_namespaces(names: list[str]) -> list[str]:
    """Delete namespaces (node namespaces before hub); returns the ones that could not be deleted."""
    failed = []
    ordered = sorted(names, key=lambda n: n.endswith("-hub"))
    for ns in ordered:
        _kill_ns_pids(ns)
    for ns in ordered:
        try:
            run_command(["ip", "netns", "del", ns], check=False, timeout=10)
        except ClusterError:
            pass
    remaining = set(_ip_netns_names())
    for ns in ordered:
        if ns in remaining:
            failed.append(ns)
        elif _NS_RE.match(ns):
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    try:
        os.rmdir(ETC_NETNS)  # only succeeds when empty
    except OSError:
        pass
    return failed


def cleanup_stale() -> list[str]:
    """Remove namespaces (and with them links/qdiscs) of runs whose process is gone.

    Only touches names matching ``cfx<pid>x<k>-(hub|n<i>)`` whose ``<pid>`` is not a live
    process.  Returns the names removed.
    """
    stale = []
    for ns in list_run_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    if stale:
        delete_namespaces(stale)
    return stale


def namespace_problem() -> str:
    """Why this machine cannot make network namespaces ("" when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "not running as root (network namespaces and tc need root)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "`ip`/`tc` not found (install iproute2: apt-get install -y iproute2)"
    return ""


def _main(argv: list[str] | None = None) -> int:
    """``python -m commfx.bench.netns [--cleanup-stale]``: remove leftovers of dead runs."""
    import argparse

    ap = argparse.ArgumentParser(description="remove or list the network namespaces of commfx clusters")
    ap.add_argument("--cleanup-stale", action="store_true", help="remove namespaces of dead runs")
    ap.add_argument("--list", action="store_true", help="list namespaces of commfx clusters")
    args = ap.parse_args(argv)
    if args.cleanup_stale:
        print("removed:", " ".join(cleanup_stale()) or "nothing")
    if args.list or not args.cleanup_stale:
        print("\n".join(list_run_namespaces()) or "(none)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
