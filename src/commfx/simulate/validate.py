"""Predicted against measured: simulate the commfx plans of a `commfx bench` JSON on the
emulated cluster with the same layout and link, and compare step times and ratios.

Peers (`peer:...`) and plans whose passes the simulator does not model are listed as
skipped. The ratio compares each plan with the run's first simulated plan, predicted and
measured alike, so a figure that holds regardless of this machine's speed that day is
judged apart from the absolute step.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..plan import Plan, PlanError
from . import UNSUPPORTED, simulate
from .cluster import Cluster, load_cluster


@dataclass
class Comparison:
    label: str
    passes: str
    measured_s: float
    predicted_s: float
    measured_compute_s: float
    predicted_compute_s: float
    measured_ratio: float = 1.0  # this plan's step / the reference plan's
    predicted_ratio: float = 1.0

    @property
    def step_error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def ratio_error(self) -> float:
        return self.predicted_ratio / self.measured_ratio - 1

    def as_dict(self) -> dict:
        return {**self.__dict__, "step_error": self.step_error, "ratio_error": self.ratio_error}


def bench_model(record: dict, json_path: Path) -> tuple[str, dict]:
    """The model spec and its arguments as the bench run built it (file models are found
    beside the JSON's folder or from the working directory)."""
    spec = record["model"]
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path = spec.split(":", 1)[0]
        for base in (Path.cwd(), json_path.resolve().parent.parent, json_path.resolve().parent):
            if (base / path).is_file():
                spec = f"{base / path}:{spec.split(':', 1)[1]}"
                break
    return spec, dict(record.get("model_kwargs") or {})


def layout_of(entry: dict, world: int) -> dict[str, int]:
    """The plan's pp, tp and ep sizes and precision as the run laid it out (JSONs before the
    bench recorded them ran a pipeline of one rank a stage: pp = world)."""
    layout = entry.get("layout") or {}
    if layout:
        return {key: layout[key] for key in ("pp", "tp", "ep", "precision") if key in layout}
    return {"pp": world} if "pipeline_split" in entry["passes"] else {}


def validate(json_path: str | Path, cluster: Cluster | None = None, *, labels: list[str] | None = None,
             precision: str = "fp32") -> tuple[list[Comparison], list[str]]:
    """(comparisons, skipped plans with why) for one bench JSON; `precision`: the plans'
    where the JSON does not say (runs from before the bench recorded it)."""
    json_path = Path(json_path)
    try:
        record = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(f"cannot read bench JSON {json_path}: {error}") from None
    for key in ("model", "nodes", "ranks_per_node", "inter_node_link", "plans"):
        if key not in record:
            raise PlanError(f"bench JSON {json_path}: field {key} is missing (is it a `commfx bench --json` file?)")
    cores = (record.get("machine") or {}).get("cpus")  # the measuring machine's, where ranks shared its cores
    cluster = (cluster or load_cluster("emulated")).with_layout(record["nodes"], record["ranks_per_node"], record["inter_node_link"], cores)
    spec, kwargs = bench_model(record, json_path)
    comparisons: list[Comparison] = []
    skipped: list[str] = []
    for entry in record["plans"]:
        passes = entry["passes"]
        if labels is not None and entry["label"] not in labels:
            continue
        if passes.startswith("peer:"):
            skipped.append(f"{entry['label']} ({passes}): a peer, not a commfx plan")
            continue
        layout = layout_of(entry, cluster.world_size)
        precision = layout.pop("precision", precision)
        plan = dataclasses.replace(Plan.from_cli(passes, world_size=cluster.world_size, **layout), precision=precision)
        unsupported = [n for n in plan.pass_names() if n in UNSUPPORTED]
        if unsupported:
            skipped.append(f"{entry['label']} ({passes}): {', '.join(unsupported)} not modelled")
            continue
        if "capacity_factor" in passes:
            skipped.append(f"{entry['label']} ({passes}): capacity mode (rows padded to each expert's capacity) not modelled")
            continue
        try:
            prediction = simulate(spec, plan, cluster, model_kwargs=kwargs)
        except PlanError as error:  # a run from before the bench recorded what the plan needs (its precision)
            skipped.append(f"{entry['label']} ({passes}): {error}")
            continue
        comparisons.append(Comparison(
            entry["label"], passes, entry["wall"]["median_s"], prediction.result.step_s,
            (entry.get("compute_only") or {}).get("median_s", 0.0), prediction.result.compute_s,
        ))
    if comparisons:
        ref = comparisons[0]
        for c in comparisons:
            c.measured_ratio = c.measured_s / ref.measured_s
            c.predicted_ratio = c.predicted_s / ref.predicted_s
    return comparisons, skipped
