"""Inter-node links of the emulated cluster: :class:`LinkSpec`, a per-node NIC rate and a
one-way latency, parsed from ``"RATE[,LATENCY]"`` in tc's units."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LinkSpec"]

# tc units; "bps" is BYTES per second in tc, as here.
_RATE_UNITS = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024.0, "mibit": 1024.0**2, "gibit": 1024.0**3,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUM_UNIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse_rate(text: str) -> float:
    m = _NUM_UNIT_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ValueError(
            f"bad link rate {text!r}: expected NUMBER+UNIT with UNIT one of "
            f"{', '.join(_RATE_UNITS)} (tc units; 'bps' means bytes/s), e.g. '1gbit', '200mbit'"
        )
    bits = float(m.group(1)) * _RATE_UNITS[unit]
    if not 8e3 <= bits <= 1e12:
        raise ValueError(f"bad link rate {text!r}: must be between 8kbit and 1tbit")
    return bits


def _parse_time(text: str) -> float:
    m = _NUM_UNIT_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m and unit == "" and float(m.group(1)) == 0.0:
        return 0.0
    if not m or unit not in _TIME_UNITS:
        raise ValueError(
            f"bad latency {text!r}: expected NUMBER+UNIT with UNIT one of "
            f"{', '.join(_TIME_UNITS)}, e.g. '1ms', '250us', '0ms'"
        )
    sec = float(m.group(1)) * _TIME_UNITS[unit]
    if sec > 10.0:
        raise ValueError(f"bad latency {text!r}: at most 10s")
    return sec


@dataclass(frozen=True)
class LinkSpec:
    """Inter-node link: per-node NIC ``rate`` (each direction) and one-way ``latency``."""

    rate: str  # tc rate, e.g. "1gbit", "200mbit"
    latency: str = "0ms"  # one-way delay added on inter-node traffic, e.g. "1ms"

    def __post_init__(self) -> None:
        _parse_rate(self.rate)
        _parse_time(self.latency)

    @property
    def rate_bits(self) -> float:
        """Rate in bits per second."""
        return _parse_rate(self.rate)

    @property
    def latency_s(self) -> float:
        """One-way latency in seconds."""
        return _parse_time(self.latency)

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """Parse ``"RATE[,LATENCY]"``, e.g. ``"1gbit"``, ``"200mbit,1ms"``."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("empty link spec: expected 'RATE[,LATENCY]', e.g. '1gbit,1ms'")
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 2 or any(not p for p in parts):
            raise ValueError(f"bad link spec {text!r}: expected 'RATE[,LATENCY]', e.g. '1gbit,1ms'")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.rate},{self.latency}"
