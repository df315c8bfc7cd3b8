"""The user-space delay line of the emulated cluster (:mod:`commfx.bench.cluster`).

Used where the kernel has no ``sch_netem``: the cluster's hub namespace routes every
packet arriving from a node into a tun device; this program reads each packet from it,
holds it for ``DELAY`` seconds and writes it back, and the hub's main routing table
forwards it to the destination node. Its cost: about 50-100 us per direction on top of
the set latency, and up to about 5gbit (the cluster gives it 64 KB packets above 1gbit).

    python path/to/delay_line.py TUN_NAME DELAY_S PARENT_PID MTU

It creates the tun device, prints ``ready`` once it exists, and runs until its parent
(``PARENT_PID``) is gone or it is terminated; Ctrl-C is ignored (the cluster stops it).
The cluster runs it by path, not with ``-m``: it imports only the standard library, so it
starts without importing commfx or torch.
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_TIMERSLACK = 29
QUEUE_CAP = 1 << 16  # packets held at once; more are dropped
READ_BATCH = 512  # packets read per wake-up


def open_tun(name: str) -> int:
    """Create the tun device `name` (no packet-info header) and return its non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def precise_timers() -> None:
    """Timer slack of 1 us, so the process wakes up on time (the default slack is 50 us)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except Exception:
        pass


def run(fd: int, delay: float, parent: int, mtu: int) -> None:
    """Hold every packet read from `fd` for `delay` seconds, then write it back, in order,
    while `parent` is this process's parent."""
    queue: collections.deque = collections.deque()
    bufsize = mtu + 64
    mono, read, write, wait_readable = time.monotonic, os.read, os.write, select.select
    while os.getppid() == parent:
        now = mono()
        while queue and queue[0][0] <= now:
            try:
                write(fd, queue.popleft()[1])
            except OSError:
                pass
        wait = min(queue[0][0] - now, 0.5) if queue else 0.5
        if wait_readable([fd], [], [], max(wait, 0.0))[0]:
            due = mono() + delay
            for _ in range(READ_BATCH):
                try:
                    packet = read(fd, bufsize)
                except (BlockingIOError, InterruptedError):
                    break
                if len(queue) < QUEUE_CAP:
                    queue.append((due, packet))


def main(argv: list[str] | None = None) -> int:
    name, delay, parent, mtu = argv if argv is not None else sys.argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    precise_timers()
    fd = open_tun(name)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    run(fd, float(delay), int(parent), int(mtu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
