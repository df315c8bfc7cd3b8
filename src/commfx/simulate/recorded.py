"""What a `commfx bench` run's plans compiled with, read from its JSON: the cost models'
figures (measured on the ranks, or given) and the automatic choices those figures made.

The simulator compiles a plan with the same figures to make the same choices, so that what
it simulates is what ran. Runs record both under each plan's `compiled_with`. Older runs
kept notes only: the probe's line (`runtime.machine_probe`, parsed to its rounding) and
partition_a2a's; runs from before the probe ran on the figures the bench put into the
topology (its link, and `--flops-per-rank`/`--collective-overhead` if given), which the
JSON does not hold: the caller passes them (`given`), else they are unknown.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.links import LinkSpec
from ..cost.figures import describe, figures_of, with_figures
from ..passes.choices import choices_from_notes
from ..plan import PlanError, Topology
from ..runtime.machine_probe import MachineFigures, measured_topology
from .cluster import Cluster

__all__ = ["SOURCES", "Compiled", "bench_topology", "compiled_with", "machine_from"]

SOURCES = ("recorded", "measured (from the run's note)", "given", "unknown")


@dataclass(frozen=True)
class Compiled:
    """One plan's compile as the run recorded it."""

    figures: dict[str, float] | None  # None: unknown (the simulator uses its cluster's)
    choices: dict[str, str] = field(default_factory=dict)  # `pass:option` -> value; {} where none were recorded
    source: str = "unknown"  # one of SOURCES
    choices_recorded: bool = False  # False: the run kept no record of its choices (nothing to check)

    def describe(self) -> str:
        return f"{describe(self.figures)} ({self.source})" if self.figures else "not recorded"


def bench_topology(record: dict, layout: dict[str, int]) -> Topology:
    """The topology `commfx bench` built for a plan before any measuring: its layout, the
    link its tc spec set, the written defaults for the rest (bench/config.py)."""
    link = record.get("inter_node_link")
    figures: dict[str, float] = {}
    if link and link != "none":
        spec = LinkSpec.parse(link)
        figures = {"inter_node_bandwidth": spec.rate_bits / 8, "inter_node_latency_s": spec.latency_s}
    sizes = {k: layout[k] for k in ("ep", "pp", "tp") if k in layout}
    return Topology(world_size=record["nodes"] * record["ranks_per_node"], ranks_per_node=record["ranks_per_node"], **sizes, **figures)


def compiled_with(entry: dict, record: dict, layout: dict[str, int], given: dict[str, float] | None = None) -> Compiled:
    """How the run compiled plan `entry` (`layout`: its pp, tp, ep); `given`: the figures its
    command set (`{}`: none) for a run that recorded neither figures nor a measurement."""
    if entry.get("compiled_with"):
        kept = entry["compiled_with"]
        return Compiled(dict(kept["figures"]), dict(kept.get("choices") or {}), "recorded", True)
    notes = entry.get("choices")
    recorded = notes is not None  # the field came with the probe: from then on partition_a2a's line was kept
    choices = choices_from_notes(notes or [])
    measured = next((f for f in map(MachineFigures.parse, notes or []) if f is not None), None)
    if measured is not None:
        return Compiled(figures_of(measured_topology(bench_topology(record, layout), measured)), choices,
                        "measured (from the run's note)", recorded)
    if given is not None:
        return Compiled(figures_of(with_figures(bench_topology(record, layout), given)), choices, "given", recorded)
    return Compiled(None, choices, "unknown", recorded)


def machine_from(json_path: str | Path, cluster: Cluster, passes: str) -> tuple[dict[str, float], str]:
    """The figures a bench run's ranks compiled with, for a simulation on `cluster` (its
    layout and link must be the run's): those of the run's plan with `passes`, else of its
    first plan that recorded them. (figures, a note saying where they came from)."""
    path = Path(json_path)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(f"--machine-from {path}: cannot read the bench JSON: {error}") from None
    if not isinstance(record, dict) or "plans" not in record:
        raise PlanError(f"--machine-from {path}: not a `commfx bench --json` file (no plans)")
    link = record.get("inter_node_link")
    spec = LinkSpec.parse(link) if link and link != "none" else None
    same_link = spec is not None and math.isclose(spec.rate_bits, cluster.inter_node.bandwidth * 8, rel_tol=1e-6) and math.isclose(
        spec.latency_s, cluster.inter_node.latency_s, rel_tol=1e-6, abs_tol=1e-9)
    if (record.get("nodes"), record.get("ranks_per_node")) != (cluster.nodes, cluster.ranks_per_node) or not same_link:
        raise PlanError(
            f"--machine-from {path}: the run measured {record.get('nodes')} node(s) x {record.get('ranks_per_node')} rank(s) at "
            f"{link or 'an unlimited link'}; this "
            f"simulation is {cluster.describe()}: its figures are another cluster's. Give --nodes, --ranks-per-node and "
            "--inter-node as the run had them"
        )
    found = []
    for entry in record["plans"]:
        if entry.get("passes", "").startswith("peer:"):
            continue
        compiled = compiled_with(entry, record, dict(entry.get("layout") or {}))
        if compiled.figures is not None:
            found.append((entry, compiled))
    if not found:
        raise PlanError(f"--machine-from {path}: no plan of the run recorded the figures it compiled with (runs since the machine probe do)")
    entry, compiled = next(((e, c) for e, c in found if e["passes"] == passes), found[0])
    return compiled.figures, f"cost models' figures from {path.name}, plan {entry['label']!r}: {compiled.describe()}"
