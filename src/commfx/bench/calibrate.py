"""Calibration helpers for the emulated cluster (:mod:`commfx.bench.cluster`).

* :func:`measure_compute_rate` -- float32 matmul FLOP/s of this machine (torch).
* :func:`measure_link` -- throughput and round-trip latency between two ranks on
  different nodes and two ranks on the same node, measured with a plain TCP socket
  pair launched through the cluster's ``rank_launch`` (inside the namespaces).
* :func:`suggest_rate` -- a link rate that gives this CPU "cluster" a GPU-like
  compute-to-communication balance.

Every function is bounded in time (``seconds`` / ``timeout`` arguments).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

__all__ = ["measure_compute_rate", "measure_link", "suggest_rate", "format_rate"]

GPU_FLOPS_PER_BYTE_RANGE = (1e3, 1e4)


def measure_compute_rate(seconds: float = 0.5, n: int = 1024, threads: int | None = None) -> float:
    """FLOP/s of an ``n x n`` float32 matmul with torch, timed for about ``seconds``.

    ``threads`` sets torch's intra-op threads for the measurement (restored after);
    None keeps the current setting (all cores by default), i.e. what one process
    gets when it has the machine to itself.
    """
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        torch.mm(a, b)  # warm-up (thread pool, allocator)
        flops_per = 2.0 * n * n * n
        best = 0.0
        deadline = time.perf_counter() + max(seconds, 0.01)
        while True:
            t = time.perf_counter()
            torch.mm(a, b)
            dt = time.perf_counter() - t
            best = max(best, flops_per / max(dt, 1e-9))
            if time.perf_counter() >= deadline:
                return best
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------- link probe

_SERVER_SRC = r"""
import socket, sys
T = float(sys.argv[1])
s = socket.socket(); s.bind(("", 0)); s.listen(1); s.settimeout(T)
print(s.getsockname()[1], flush=True)
a, _ = s.accept(); a.settimeout(T); a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20); mv = memoryview(buf)
def recvall(n):
    out = b""
    while len(out) < n:
        c = a.recv(n - len(out))
        if not c: raise EOFError
        out += c
    return out
while True:
    op = a.recv(1)
    if not op: break
    if op == b"p": a.sendall(b"p")
    elif op == b"d":
        left = int.from_bytes(recvall(8), "little")
        while left:
            k = a.recv_into(mv[: min(left, len(buf))])
            if not k: raise EOFError
            left -= k
        a.sendall(b"k")
"""

_CLIENT_SRC = r"""
import json, socket, sys, time
addr, port, nbytes, pings, reps, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
s = socket.create_connection((addr, port), timeout=T); s.settimeout(T)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(pings):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtts.append(time.perf_counter() - t)
payload = bytes(nbytes); times = []
for _ in range(reps):
    t = time.perf_counter(); s.sendall(b"d" + nbytes.to_bytes(8, "little")); s.sendall(payload)
    if s.recv(1) != b"k": raise SystemExit("bad ack")
    times.append(time.perf_counter() - t)
s.close()
print(json.dumps({"rtts": rtts, "times": times}), flush=True)
"""


def _bounded_line(proc: subprocess.Popen, timeout: float) -> str:
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if r else ""


def _probe(cluster, server_rank: int, client_rank: int, addr: str, nbytes: int,
           pings: int, reps: int, timeout: float) -> dict:
    srv_l, cli_l = cluster.rank_launch(server_rank), cluster.rank_launch(client_rank)
    env = dict(os.environ)
    srv = subprocess.Popen(
        srv_l.prefix + [sys.executable, "-c", _SERVER_SRC, str(timeout)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        port = _bounded_line(srv, timeout)
        if not port.isdigit():
            raise RuntimeError(f"link probe server did not start: {port!r}")
        cli = subprocess.run(
            cli_l.prefix + [sys.executable, "-c", _CLIENT_SRC, addr, port, str(nbytes),
                            str(pings), str(reps), str(timeout)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env,
        )
        if cli.returncode != 0:
            raise RuntimeError(f"link probe client failed: {cli.stderr.strip()[-500:]}")
        res = json.loads(cli.stdout.strip().splitlines()[-1])
    finally:
        if srv.poll() is None:
            srv.kill()
        try:
            srv.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    rtts = sorted(res["rtts"])
    best = min(res["times"])
    return {
        "ranks": (server_rank, client_rank),
        "bytes": nbytes,
        "throughput_bits": nbytes * 8 / best,
        "throughput_Bps": nbytes / best,
        "rtt_s": rtts[len(rtts) // 2],  # median, 1-byte ping-pong with TCP_NODELAY
        "one_way_s": rtts[len(rtts) // 2] / 2,
    }


def measure_link(cluster, nbytes: int | None = None, pings: int = 20, reps: int = 2,
                 timeout: float = 60.0) -> dict:
    """Throughput and latency between rank 0 and a rank on another node (``"inter"``)
    and between rank 0 and a rank on rank 0's node (``"intra"``).

    A TCP socket pair is launched with the cluster's ``rank_launch`` prefixes (so it runs
    inside the namespaces, like the ranks do).  Throughput: best of ``reps`` transfers of
    ``nbytes`` (default: ~0.5 s worth at the set rate, 256 KiB..8 MiB) until the receiver
    acknowledges.  Latency: median round trip of ``pings`` 1-byte ping-pongs.  Each probe
    is bounded by ``timeout`` seconds.  ``"inter"`` is None for a one-node cluster.
    """
    if nbytes is None:
        nbytes = 8 << 20
        if cluster.link is not None:
            nbytes = int(min(8 << 20, max(256 << 10, cluster.link.rate_bits / 8 * 0.5)))
    rpn = cluster.ranks_per_node
    out = {
        "emulated": cluster.emulated,
        "set_rate_bits": cluster.link.rate_bits if cluster.link else None,
        "set_latency_s": cluster.link.latency_s if cluster.link else None,
        "inter": None,
        "intra": None,
    }
    addr = cluster.master_addr
    if cluster.nodes > 1:
        out["inter"] = _probe(cluster, 0, rpn, addr, nbytes, pings, reps, timeout)
    intra_peer = 1 if rpn > 1 else 0  # same node either way
    out["intra"] = _probe(cluster, 0, intra_peer, addr, 8 << 20, pings, reps, timeout)
    return out


# --------------------------------------------------------------------------- rate advice


def format_rate(bits_per_s: float) -> str:
    """A tc rate string: ``"1500kbit"``, ``"133mbit"``, ``"2500mbit"``."""
    if bits_per_s >= 10e6:
        return f"{round(bits_per_s / 1e6)}mbit"
    return f"{max(8, round(bits_per_s / 1e3))}kbit"


def suggest_rate(
    model_flops_per_step: float,
    bytes_per_step: float,
    target_flops_per_byte: float = 3e3,
    *,
    compute_rate: float | None = None,
    world_size: int = 1,
    ranks_per_node: int = 1,
) -> dict:
    """Suggest an inter-node link rate so this CPU cluster has a GPU-like balance.

    Reasoning.  What decides whether communication is exposed is the *machine balance*:
    FLOP/s a rank computes divided by the bytes/s it can move between nodes.  For GPU
    clusters that ratio is roughly 1e3..1e4 FLOPs per byte: an H100 does ~1e15 dense
    bf16 FLOP/s peak (~4-6e14 achieved) with a 400 Gbit/s (50 GB/s) NIC per GPU, i.e.
    ~1e4 (2e4 at peak); an A100 (3.1e14) with 200 Gbit/s per GPU is ~1e4 at peak, ~5e3
    achieved; NVLink-class bandwidth (hundreds of GB/s) brings it to ~1e3.  A CPU doing
    ~1e11 FLOP/s against a 10 Gbit/s veth would sit near 1e2, so communication would look
    far cheaper than on GPUs.  Matching the balance keeps the *time split* between
    compute and communication of a workload similar to the GPU cluster's::

        link bytes/s per rank = compute FLOP/s per rank / target_flops_per_byte
        node rate             = ranks_per_node * link bytes/s per rank * 8   (one NIC per node)

    Arguments:
        model_flops_per_step: FLOPs one rank computes per training step.
        bytes_per_step: bytes one rank sends to other nodes per step.
        target_flops_per_byte: machine balance to emulate (1e3..1e4; default 3e3, the
            geometric middle).
        compute_rate: FLOP/s of the whole machine (default: :func:`measure_compute_rate`).
        world_size: ranks running concurrently on this machine (they share its cores,
            so each gets ``compute_rate / world_size``).
        ranks_per_node: ranks sharing one emulated node's link.

    Returns a dict with ``rate`` (tc string for :class:`LinkSpec`), ``rate_bits``,
    the per-rank compute rate and link bytes/s, and the predicted per-step ``compute_s``,
    ``comm_s`` and ``comm_fraction`` (= comm_s / (compute_s + comm_s), no overlap) at
    that rate, plus ``workload_flops_per_byte`` (model_flops_per_step / bytes_per_step);
    when that is below the target the step is communication-bound on the emulated
    cluster just as it would be on the GPU cluster.  ``note`` flags rates the emulation
    cannot deliver well.
    """
    if model_flops_per_step <= 0 or bytes_per_step < 0:
        raise ValueError("model_flops_per_step must be > 0 and bytes_per_step >= 0")
    if target_flops_per_byte <= 0 or world_size < 1 or ranks_per_node < 1:
        raise ValueError("target_flops_per_byte > 0, world_size >= 1, ranks_per_node >= 1 required")
    if compute_rate is None:
        compute_rate = measure_compute_rate()
    per_rank_flops = compute_rate / world_size
    per_rank_Bps = per_rank_flops / target_flops_per_byte
    node_bits = per_rank_Bps * 8 * ranks_per_node
    rate = format_rate(node_bits)
    compute_s = model_flops_per_step / per_rank_flops
    comm_s = bytes_per_step / per_rank_Bps
    note = ""
    lo, hi = GPU_FLOPS_PER_BYTE_RANGE
    if not lo <= target_flops_per_byte <= hi:
        note += f"target {target_flops_per_byte:g} FLOP/B is outside the GPU-like range {lo:g}..{hi:g}. "
    if node_bits > 5e9:
        note += "rates above ~5gbit are not shaped reliably by tbf/veth on a small CPU machine. "
    if node_bits < 1e6:
        note += "very low rate: TCP timers and tbf burst dominate; prefer a larger target or fewer ranks. "
    return {
        "rate": rate,
        "rate_bits": node_bits,
        "compute_rate_per_rank": per_rank_flops,
        "link_Bps_per_rank": per_rank_Bps,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "comm_fraction": comm_s / (compute_s + comm_s) if compute_s + comm_s > 0 else 0.0,
        "workload_flops_per_byte": model_flops_per_step / bytes_per_step if bytes_per_step else float("inf"),
        "target_flops_per_byte": target_flops_per_byte,
        "note": note.strip(),
    }


def _main(argv: list[str] | None = None) -> int:
    """``python -m commfx.bench.calibrate --link 200mbit,1ms``: print measurements."""
    import argparse

    from commfx.bench.cluster import EmulatedCluster
    from commfx.bench.links import LinkSpec

    ap = argparse.ArgumentParser(description="measure compute rate and emulated link")
    ap.add_argument("--link", default="1gbit", help="RATE[,LATENCY] or 'none'")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=None)
    args = ap.parse_args(argv)
    link = None if args.link == "none" else LinkSpec.parse(args.link)
    print(f"compute: {measure_compute_rate() / 1e9:.1f} GFLOP/s (float32 matmul)")
    with EmulatedCluster(args.nodes, args.ranks_per_node, link) as c:
        print(c.describe())
        res = measure_link(c, nbytes=args.bytes)
    for k in ("inter", "intra"):
        r = res[k]
        if r:
            print(f"{k}: ranks {r['ranks']}: {r['throughput_bits'] / 1e6:.0f} Mbit/s "
                  f"({r['bytes']} B), rtt {r['rtt_s'] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
