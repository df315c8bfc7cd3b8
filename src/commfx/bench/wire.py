"""Bytes on the wire: the emulated links' own counters, and the floor they put under a step.

**Which counters.** Each node's end of its inter-node link: the veth ``Pn<i>`` inside the
node's namespace (:mod:`commfx.bench.cluster`). That device is the node's NIC: its
``tx_bytes`` is everything node *i* put on its link (the ``tbf`` on its egress shapes exactly
these bytes to the link rate), its ``rx_bytes`` everything delivered to it (shaped by the
``tbf`` on the hub end). Intra-node traffic goes over the namespace's loopback and never
touches it. The hub's side is not read: without ``sch_netem`` the hub hands every packet
to a user-space delay line through a tun device and forwards it again (the packet shows
up on ``Ph<i>``, on the tun twice and on ``Ph<j>``), whereas each inter-node packet crosses
exactly one node end on the way out and one on the way in, wherever it was delayed.

The figures are the kernel's per-device statistics as ``/proc/self/net/dev`` lists them for
the reading process's own network namespace (a rank runs inside its node's namespace; the
parent reads a node's through ``ip netns exec``). The bench reads them between two barriers
before a training step and after a barrier that follows it (see its worker). They count
bytes of whole frames, so Ethernet, IP and TCP headers, TCP acknowledgements and gloo's own
framing and barriers are in them, which is why they exceed the scheduler's payload count
by a little (:data:`AGREEMENT_TOLERANCE`).

**The bound.** A link carries ``rate`` bits a second in each direction (full duplex, one
``tbf`` per direction), so a step can not be faster than its busiest link direction's bytes
÷ rate, plus one one-way latency for each collective that must wait for the one before it
(:func:`wire_bound`), nor faster than its compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AGREEMENT_TOLERANCE", "LinkCounters", "parse_net_dev", "read_counters", "wire_bound"]

AGREEMENT_TOLERANCE = 0.10  # a commfx plan's wire bytes vs the scheduler's own count (headers, TCP/IP)
NET_DEV = "/proc/self/net/dev"  # per network namespace: the reading process's own


@dataclass(frozen=True)
class LinkCounters:
    """One device's byte and packet counters (since the device was made)."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int = 0
    tx_packets: int = 0

    def __sub__(self, other: "LinkCounters") -> "LinkCounters":
        return LinkCounters(self.rx_bytes - other.rx_bytes, self.tx_bytes - other.tx_bytes,
                            self.rx_packets - other.rx_packets, self.tx_packets - other.tx_packets)


def parse_net_dev(text: str) -> dict[str, LinkCounters]:
    """``/proc/net/dev`` text -> device name -> counters.

    After two header lines, one line per device: ``NAME: rx_bytes rx_packets errs drop fifo
    frame compressed multicast tx_bytes tx_packets ...`` (the colon may touch the first number).
    """
    devices = {}
    for line in text.splitlines()[2:]:
        name, colon, rest = line.partition(":")
        fields = rest.split()
        if not colon or len(fields) < 10:
            raise ValueError(f"unexpected line in net/dev: {line!r}")
        numbers = [int(f) for f in fields]
        devices[name.strip()] = LinkCounters(rx_bytes=numbers[0], tx_bytes=numbers[8], rx_packets=numbers[1], tx_packets=numbers[9])
    return devices


def read_counters(device: str, path: str = NET_DEV) -> LinkCounters:
    """The counters of `device` in this process's network namespace (microseconds: one read)."""
    with open(path) as f:
        devices = parse_net_dev(f.read())
    try:
        return devices[device]
    except KeyError:
        raise ValueError(f"no device {device!r} in this network namespace (have {', '.join(sorted(devices))})") from None


def wire_bound(compute_s: float, busiest_link_bytes: float, rate_bits: float, messages: float = 0.0,
               latency_s: float = 0.0) -> float:
    """``max(compute-only, busiest link's bytes ÷ rate + messages × one-way latency)``, seconds.

    `busiest_link_bytes` is the larger direction of the busiest node's link (each direction
    has the full rate); `messages` is the number of node-crossing collectives one lane of one
    rank issues in the step (a lane issues a collective only once the one before it is
    done, and each pays at least one one-way latency), the longest lane's count. The sum is
    a strict floor when one lane carries the traffic; where lanes run side by side one
    lane's latencies can hide under another's bytes, so it may overstate the floor by up to
    ``messages × latency`` (nothing at latency 0).
    """
    if rate_bits <= 0:
        raise ValueError(f"link rate must be positive, got {rate_bits}")
    return max(compute_s, busiest_link_bytes * 8 / rate_bits + messages * latency_s)
