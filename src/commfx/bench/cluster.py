"""Emulated multi-node cluster on one Linux machine, for communication benchmarks.

Every emulated node is a Linux network namespace; the ranks of one node talk to each
other over that namespace's own address (the kernel routes it over loopback, so it is
fast), and the nodes are joined through a hub namespace by veth pairs whose ``tc``
qdiscs limit bandwidth and add one-way latency.

Layout for ``nodes=N`` (``T`` is the run tag ``cfx<pid>x<k>``, ``P`` is ``cfx<pid>``)::

    netns T-hub : lo, Ph0 .. Ph{N-1}   veth ends, Ph<i> = 10.231.<i>.1/24, ip_forward=1
                  Pd                   tun of the user-space delay line (see below)
    netns T-n<i>: lo, Pn<i>            veth peer of Ph<i>, 10.231.<i>.2/24,
                                       route 10.231.0.0/16 via 10.231.<i>.1

The hub is a router (one /24 per node), not a bridge, so that inter-node packets go
through IP routing, where the delay line can be inserted.

* bandwidth: ``tbf`` as root qdisc on both ends of every veth (egress of ``Pn<i>`` =
  what node i sends, egress of ``Ph<i>`` = what node i receives), i.e. a full-duplex
  NIC of ``rate`` per node.  Intra-node traffic never touches a veth.
* latency (one way, applied once to each inter-node packet): ``netem delay`` as root
  qdisc of every hub-side veth with the ``tbf`` as its child, when the kernel has
  sch_netem.  Otherwise (e.g. kernels built without CONFIG_NET_SCH_NETEM) a user-space
  delay line in the hub namespace: policy routing (``ip rule iif Ph<i> lookup 100``,
  table 100: ``default dev Pd``) hands every packet arriving from a node to a tun
  device; a small Python program (:mod:`commfx.bench.delay_line`) holds it for
  ``latency`` and writes it back, and the main table forwards it to the destination veth.
* bytes on the wire: every node's ``Pn<i>`` counters (:meth:`EmulatedCluster.link_counters`,
  :mod:`commfx.bench.wire`), what node i sent and received over its link.

Nothing is created in the host's root network namespace: all links, addresses, routes
and qdiscs live in namespaces this module creates, and the address plan
(10.231.0.0/16) is only used inside them (nodes have no default route, so no packet can
leave).  Host-visible are only the ``/run/netns/<name>`` handles of ``ip netns`` and
``/etc/netns/<node ns>/hosts`` files (see below).  Everything is removed on exit, on an
exception and on SIGINT/SIGTERM/SIGHUP; :func:`cleanup_stale` removes leftovers of runs
whose process died (SIGKILL); ``python -m commfx.bench.netns --cleanup-stale`` too.

When namespaces cannot be made (not root, no ``ip`` binary, kernel refuses) the cluster
falls back to plain localhost (``emulated`` is False, ``reason`` says why), unless
``allow_fallback=False``, which raises :class:`ClusterUnavailable`.

Gloo: ``GLOO_SOCKET_IFNAME`` is set to the node's veth, so gloo binds to the node
address.  Without it gloo resolves the machine's hostname, which /etc/hosts usually maps
to 127.0.0.1 (unreachable from other nodes); so each node namespace also gets an
``/etc/netns/<ns>/hosts`` (bind-mounted over /etc/hosts by ``ip netns exec``) mapping the
hostname to the node address and naming every node address (also the v4-mapped IPv6
form, which c10d reverse-resolves for TCPStore clients).  Ports inside the namespaces are
free (fresh namespaces), so any ``MASTER_PORT`` works; see
:meth:`EmulatedCluster.suggest_port`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from . import delay_line
from .links import LinkSpec
from .netns import (ETC_NETNS, NAME_PREFIX, SUBNET, ClusterError, cleanup_stale, delete_namespaces, list_run_namespaces,
                    namespace_problem, run_command)
from .wire import LinkCounters, parse_net_dev

__all__ = ["EmulatedCluster", "RankLaunch", "ClusterUnavailable"]

_RT_TABLE = "100"  # policy-routing table of the delay line (inside the hub namespace)
_RUN_COUNTER = itertools.count()


class ClusterUnavailable(RuntimeError):
    """Network namespaces could not be created and fallback was not allowed."""


@dataclass(frozen=True)
class RankLaunch:
    """How to start one rank: run ``prefix + argv`` with ``env`` merged into the environment."""

    prefix: list[str]  # e.g. ["ip", "netns", "exec", ns]; [] on fallback
    env: dict[str, str] = field(default_factory=dict)  # MASTER_ADDR, GLOO_SOCKET_IFNAME, NODE_RANK, LOCAL_RANK


def _readline_bounded(stream, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


class EmulatedCluster:
    """Context manager: ``nodes`` namespaces of ``ranks_per_node`` ranks joined by ``link``.

    ``link=None`` means unlimited inter-node links (veth speed).  ``delay_backend`` picks
    how latency is added: ``"auto"`` (netem if the kernel has it, else the tun delay
    line), ``"netem"`` or ``"tun"``.  ``mtu`` is the MTU of the inter-node links
    (default: 9000, jumbo frames as in a datacenter; 65000 when the tun delay line
    carries more than 1gbit, since it forwards a limited number of packets per second).
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int,
        link: LinkSpec | None,
        *,
        allow_fallback: bool = True,
        delay_backend: str = "auto",
        mtu: int | None = None,
        clean_stale: bool = True,
    ) -> None:
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError("nodes and ranks_per_node must be >= 1")
        if nodes > 250:
            raise ValueError("at most 250 nodes")
        if delay_backend not in ("auto", "netem", "tun"):
            raise ValueError("delay_backend must be 'auto', 'netem' or 'tun'")
        if mtu is not None and not 1280 <= mtu <= 65000:
            raise ValueError("mtu must be in [1280, 65000]")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.link = link
        self.allow_fallback = allow_fallback
        self.delay_backend = delay_backend
        self.mtu = mtu
        self.clean_stale = clean_stale

        pid = os.getpid()
        self.tag = f"{NAME_PREFIX}{pid}x{next(_RUN_COUNTER)}"
        self._ifp = f"{NAME_PREFIX}{pid}"  # interface-name prefix (<= 15 chars with suffix)
        self.hub_ns = f"{self.tag}-hub"
        self.node_ns = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.node_if = [f"{self._ifp}n{i}" for i in range(nodes)]
        self.hub_if = [f"{self._ifp}h{i}" for i in range(nodes)]
        self.tun_if = f"{self._ifp}d"

        self.emulated = False
        self.reason = "not started"
        self.master_addr = "127.0.0.1"
        self.latency_backend = "none"  # "netem" | "tun" | "none"
        self.netem_error = ""
        self._created: list[str] = []
        self._delay_proc: subprocess.Popen | None = None
        self._cleaning = False
        self._pending_signal: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ public API

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return rank // self.ranks_per_node

    def node_addr(self, node: int) -> str:
        """Address of ``node`` (reachable from every node); 127.0.0.1 on fallback."""
        return f"{SUBNET}.{node}.2" if self.emulated else "127.0.0.1"

    def rank_launch(self, rank: int) -> RankLaunch:
        node = self.node_of(rank)
        env = {
            "MASTER_ADDR": self.master_addr,
            "NODE_RANK": str(node),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
        }
        if self.emulated:
            env["GLOO_SOCKET_IFNAME"] = self.node_if[node]
            return RankLaunch(["ip", "netns", "exec", self.node_ns[node]], env)
        env["GLOO_SOCKET_IFNAME"] = "lo"
        return RankLaunch([], env)

    def suggest_port(self) -> int:
        """A port for MASTER_PORT: fixed 29500 inside fresh namespaces, a free one on fallback."""
        if self.emulated:
            return 29500
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def link_devices(self) -> tuple[str, ...]:
        """Per node, the device whose counters are its inter-node link's: the node end of its
        veth (see :mod:`commfx.bench.wire` for why that end); () when there is no link to
        count (one node, or the localhost fallback)."""
        return tuple(self.node_if) if self.emulated and self.nodes > 1 else ()

    def link_counters(self) -> list[LinkCounters]:
        """Every node's link counters now, read from the parent through ``ip netns exec``
        (a rank reads its own node's with :func:`commfx.bench.wire.read_counters`)."""
        devices = self.link_devices()
        if not devices:
            raise ClusterError(f"no inter-node links to count ({self.describe()})")
        out = []
        for ns, dev in zip(self.node_ns, devices):
            text = run_command(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"]).stdout
            out.append(parse_net_dev(text)[dev])
        return out

    def describe(self) -> str:
        if self.link is None:
            lk = "unlimited links"
        else:
            lk = f"link {self.link.rate}, latency {self.link.latency}"
            if self.link.latency_s > 0 and self.emulated:
                lk += " (netem)" if self.latency_backend == "netem" else " (user-space tun delay line)"
        head = f"{self.nodes} nodes x {self.ranks_per_node} ranks/node, {lk}"
        if self.emulated:
            return f"{head}, emulated (netns {self.tag}-*)"
        return f"{head}, FALLBACK plain localhost, links not emulated ({self.reason})"

    def __repr__(self) -> str:
        return f"EmulatedCluster({self.describe()})"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "EmulatedCluster":
        problem = self._preflight()
        if problem:
            self._fall_back(problem)
            return self
        self._install_signal_handlers()
        atexit.register(self._cleanup)
        try:
            if self.clean_stale:
                cleanup_stale()
            self._create()
        except ClusterError as e:
            self._undo()
            self._fall_back(f"namespace setup failed: {e}")
            return self
        except BaseException:
            self._undo()
            raise
        self.emulated = True
        self.reason = ""
        self.master_addr = self.node_addr(0)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        """Remove everything (idempotent); re-delivers a signal that arrived meanwhile.

        Processes still running inside the cluster's namespaces (ranks that did not
        exit) are killed: a namespace cannot go away while a process is in it."""
        self._cleanup()
        self._restore_signal_handlers()
        atexit.unregister(self._cleanup)
        pending, self._pending_signal = self._pending_signal, None
        if pending is not None:
            signal.raise_signal(pending)

    _undo = close

    # ------------------------------------------------------------------ internals

    def _preflight(self) -> str:
        return namespace_problem()

    def _fall_back(self, why: str) -> None:
        if not self.allow_fallback:
            raise ClusterUnavailable(
                f"cannot create an emulated cluster: {why}. Fix: run as root on Linux with "
                "iproute2 installed (`apt-get install -y iproute2`), or pass allow_fallback=True "
                "to run on plain localhost without link emulation."
            )
        self.emulated = False
        self.reason = why
        self.master_addr = "127.0.0.1"
        self.latency_backend = "none"

    def _ns_sh(self, ns: str, script: str) -> None:
        run_command(["ip", "netns", "exec", ns, "sh", "-c", script])

    def _add_ns(self, ns: str) -> None:
        self._created.append(ns)  # record first: cleanup tries even if `add` half-worked
        run_command(["ip", "netns", "add", ns])

    def _write_hosts(self, i: int) -> None:
        """/etc/hosts as seen inside node i (via `ip netns exec`): the machine's hostname
        resolves to the node's own address (so gloo's default device selection, which
        resolves the hostname, picks the node address) and every node address has a name
        (so c10d's reverse lookups of peers succeed without DNS)."""
        d = os.path.join(ETC_NETNS, self.node_ns[i])
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        host = socket.gethostname()
        for j in range(self.nodes):
            names = [f"{self.tag}-n{j}", f"node{j}"] + ([host] if j == i and host else [])
            lines.append(f"{SUBNET}.{j}.2 " + " ".join(dict.fromkeys(names)))
            # reverse lookups of v4-mapped peers (TCPStore listens on [::]); own names so
            # that forward lookups of the names above never return an IPv6 address
            lines.append(f"::ffff:{SUBNET}.{j}.2 {self.tag}-n{j}-v4mapped")
        try:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
        except OSError:
            pass  # best effort: GLOO_SOCKET_IFNAME alone is enough for gloo

    def _tbf(self, ns: str, dev: str, parent: list[str]) -> None:
        assert self.link is not None
        rate_bytes = self.link.rate_bits / 8
        burst = int(max(2 * self.mtu + 2048, rate_bytes * 0.001))  # >= 2 packets, ~1 ms of traffic
        limit = int(max(4 * burst, rate_bytes * 0.02))  # ~20 ms queue
        run_command(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf",
              "rate", f"{int(self.link.rate_bits)}bit", "burst", str(burst), "limit", str(limit)])

    def _create(self) -> None:
        quiet_v6 = (
            "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6; "
            "do [ -w $f ] && echo 1 > $f; done; true"
        )
        hub = self.hub_ns
        self._add_ns(hub)
        run_command(["ip", "-n", hub, "link", "set", "lo", "up"])
        self._ns_sh(hub, "echo 1 > /proc/sys/net/ipv4/ip_forward; "
                    "echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; "
                    "echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter; " + quiet_v6)
        self.latency_backend = self._pick_latency_backend()
        if self.mtu is None:
            # jumbo frames as in a datacenter; the Python delay line moves ~20k packets/s,
            # so above 1gbit it gets 64 KB packets to keep up (measured: 9000 -> ~2.2gbit max)
            fast = self.link is not None and self.link.rate_bits > 1e9
            self.mtu = 65000 if self.latency_backend == "tun" and fast else 9000
        for i, ns in enumerate(self.node_ns):
            self._add_ns(ns)
            self._write_hosts(i)
            self._ns_sh(ns, quiet_v6)
            run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
            hif, nif = self.hub_if[i], self.node_if[i]
            run_command(["ip", "-n", hub, "link", "add", hif, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", nif, "netns", ns, "mtu", str(self.mtu)])
            run_command(["ip", "-n", hub, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", hif])
            run_command(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", nif])
            run_command(["ip", "-n", hub, "link", "set", hif, "up"])
            run_command(["ip", "-n", ns, "link", "set", nif, "up"])
            run_command(["ip", "-n", ns, "route", "add", f"{SUBNET}.0.0/16", "via", f"{SUBNET}.{i}.1"])
        if self.link is not None:
            self._shape()
        self._wait_links_up()

    def _pick_latency_backend(self) -> str:
        """"none" without latency; else netem when the kernel has it (probed on the hub's
        lo), else the user-space tun delay line."""
        if self.link is None or self.link.latency_s <= 0:
            return "none"
        if self.delay_backend == "tun":
            return "tun"
        try:
            run_command(["tc", "-n", self.hub_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"])
            run_command(["tc", "-n", self.hub_ns, "qdisc", "del", "dev", "lo", "root"], check=False)
            return "netem"
        except ClusterError as e:
            if self.delay_backend == "netem":
                raise ClusterError(f"netem requested but unavailable: {e}") from e
            self.netem_error = str(e)  # e.g. kernel without CONFIG_NET_SCH_NETEM
            return "tun"

    def _shape(self) -> None:
        assert self.link is not None
        hub = self.hub_ns
        backend = self.latency_backend
        for i, ns in enumerate(self.node_ns):
            self._tbf(ns, self.node_if[i], ["root"])  # what node i sends
            hif = self.hub_if[i]
            if backend == "netem":
                run_command(["tc", "-n", hub, "qdisc", "add", "dev", hif, "root", "handle", "1:", "netem",
                      "delay", f"{int(round(self.link.latency_s * 1e6))}us", "limit", "100000"])
                self._tbf(hub, hif, ["parent", "1:1", "handle", "10:"])  # what node i receives
            else:
                self._tbf(hub, hif, ["root"])  # what node i receives
        if backend == "tun":
            self._start_delay_line(self.link.latency_s)

    def _wait_links_up(self, timeout: float = 5.0) -> None:
        """veth carrier comes up asynchronously (linkwatch, up to ~1 s); until then the
        device drops packets, which would cost the first TCP SYN a 1 s retransmit."""
        pending = [(self.hub_ns, d) for d in self.hub_if] + list(zip(self.node_ns, self.node_if))
        deadline = time.monotonic() + timeout
        while pending:
            out = run_command(["ip", "-n", pending[0][0], "-o", "link", "show", "dev", pending[0][1]]).stdout
            if "state UP" in out and "NO-CARRIER" not in out:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ClusterError(f"link {pending[0][1]} in {pending[0][0]} not up after {timeout}s: {out.strip()}")
            time.sleep(0.05)

    def _start_delay_line(self, delay: float) -> None:
        hub, tun = self.hub_ns, self.tun_if
        self._delay_proc = subprocess.Popen(
            ["ip", "netns", "exec", hub, sys.executable, os.path.abspath(delay_line.__file__),
             tun, repr(delay), str(os.getpid()), str(self.mtu)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # stopped by us (or exits when we die), not by Ctrl-C
        )
        line = _readline_bounded(self._delay_proc.stdout, 15.0)
        if line != "ready":
            err = ""
            if self._delay_proc.poll() is not None:
                err = self._delay_proc.stderr.read().decode(errors="replace")[-500:]
            raise ClusterError(f"delay line did not start ({line!r}): {err.strip()}")
        run_command(["ip", "-n", hub, "link", "set", tun, "mtu", str(self.mtu), "up"])
        self._ns_sh(hub, f"echo 0 > /proc/sys/net/ipv4/conf/{tun}/rp_filter")
        run_command(["ip", "-n", hub, "route", "add", "default", "dev", tun, "table", _RT_TABLE])
        for hif in self.hub_if:
            run_command(["ip", "-n", hub, "rule", "add", "iif", hif, "lookup", _RT_TABLE, "pref", "100"])

    def _stop_delay_line(self) -> None:
        p, self._delay_proc = self._delay_proc, None
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    pass
        for s in (p.stdout, p.stderr):
            try:
                s.close()
            except Exception:
                pass

    def _cleanup(self) -> None:
        with self._lock:
            if self._cleaning:
                return
            self._cleaning = True
            try:
                self._stop_delay_line()
                if self._created:
                    # also any namespace of this run tag that we may have lost track of
                    names = set(self._created) | {n for n in list_run_namespaces() if n.startswith(self.tag + "-")}
                    failed = delete_namespaces(sorted(names))
                    self._created = failed
                    if failed:
                        print(f"commfx.cluster: could not delete namespaces {failed}; "
                              "run commfx.bench.cluster.cleanup_stale() later", file=sys.stderr)
            finally:
                self._cleaning = False

    # signals: clean up first, then behave as the previous handler would have.
    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # atexit + __exit__ still clean up
        for sig in self._SIGNALS:
            try:
                if signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # the process does not die of it, so nothing to clean up
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in list(self._old_handlers.items()):
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._old_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        if self._cleaning:
            self._pending_signal = signum  # re-raised after the running cleanup finishes
            return
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self._cleanup()
        self._restore_signal_handlers()
        if callable(old):
            old(signum, frame)  # e.g. default_int_handler -> KeyboardInterrupt
        elif old == signal.SIG_DFL or old is None:
            signal.raise_signal(signum)  # default action (terminate) now that we are clean
