"""Predicted against measured: simulate the commfx plans of a `commfx bench` JSON on the
emulated cluster with the same layout and link, and compare step times and ratios.

Each plan is compiled with the cost models' figures the run compiled it with (`recorded`),
so the simulator makes the automatic choices the run made (partition_a2a's k and the like);
where a recorded choice differs from the simulator's, the prediction would be of another
program than the one measured, and validation fails (`ChoiceMismatch`) naming the option,
both values and both sets of figures. A run the cluster was fitted to (`fitted_to`) is
marked in-sample.

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

from ..cost.figures import describe, figures_of
from ..plan import Plan, PlanError
from . import UNSUPPORTED, Prediction, simulate
from .cluster import Cluster, load_cluster
from .recorded import Compiled, compiled_with


class ChoiceMismatch(PlanError):
    """The simulator compiled a plan with other automatic choices than the run did."""


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
    fitted: bool = False  # the run is one the cluster's figures were fitted to (in-sample)
    choices: dict[str, str] = dataclasses.field(default_factory=dict)  # automatic choices, the same on both sides
    unchecked: list[str] = dataclasses.field(default_factory=list)  # automatic options the run did not record
    figures: str = ""  # where the cost models' figures came from

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
             precision: str = "fp32", given: dict[str, float] | None = None,
             on_mismatch: str = "raise") -> tuple[list[Comparison], list[str]]:
    """(comparisons, skipped plans with why) for one bench JSON; `precision`: the plans'
    where the JSON does not say (runs from before the bench recorded it); `given`: the cost
    models' figures its command set where the JSON records neither them nor a measurement
    (`recorded.compiled_with`). A plan whose automatic choices differ from the run's raises
    `ChoiceMismatch` (`on_mismatch="skip"`: listed among the skipped with the same message)."""
    if on_mismatch not in ("raise", "skip"):
        raise ValueError(f"on_mismatch must be raise or skip, got {on_mismatch!r}")
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
        compiled = compiled_with(entry, record, layout, given)
        try:
            prediction = simulate(spec, plan, cluster, model_kwargs=kwargs, figures=compiled.figures)
        except PlanError as error:  # a run from before the bench recorded what the plan needs (its precision)
            skipped.append(f"{entry['label']} ({passes}): {error}")
            continue
        differ = mismatches(prediction, compiled)
        if differ:
            error = ChoiceMismatch(explain(json_path.name, entry, prediction, compiled, differ, cluster))
            if on_mismatch == "raise":
                raise error
            skipped.append(str(error))
            continue
        comparisons.append(Comparison(
            entry["label"], passes, entry["wall"]["median_s"], prediction.result.step_s,
            (entry.get("compute_only") or {}).get("median_s", 0.0), prediction.result.compute_s,
            fitted=json_path.name in cluster.fitted_to, choices=dict(prediction.choices),
            unchecked=sorted(k for k in prediction.choices if k not in compiled.choices),
            figures=compiled.source if compiled.figures else f"the {cluster.name} cluster's (the run's are not recorded)",
        ))
    if comparisons:
        ref = comparisons[0]
        for c in comparisons:
            c.measured_ratio = c.measured_s / ref.measured_s
            c.predicted_ratio = c.predicted_s / ref.predicted_s
    return comparisons, skipped


def mismatches(prediction: Prediction, compiled: Compiled) -> dict[str, tuple[str, str]]:
    """`pass:option` -> (simulator's value, run's value) where both chose and differ."""
    return {key: (value, compiled.choices[key]) for key, value in sorted(prediction.choices.items())
            if key in compiled.choices and compiled.choices[key] != value}


def explain(run: str, entry: dict, prediction: Prediction, compiled: Compiled, differ: dict, cluster: Cluster) -> str:
    """Which option, both values, and the figures each side chose them by."""
    options = "; ".join(f"{key}: the simulator compiled {mine}, the run's ranks compiled {theirs}" for key, (mine, theirs) in differ.items())
    ours = describe(figures_of(prediction.plan.topology))
    if compiled.figures is None:
        why = (f"The simulator chose with the {cluster.name} cluster's figures ({ours}); the run did not record the figures it chose "
               "with: rerun the bench (it records them) or pass the figures its command gave")
    elif compiled.figures == figures_of(prediction.plan.topology):
        why = (f"Both chose with the same figures ({ours}), so the two compiles differ elsewhere: the model, its tokens per rank, "
               "the precision or the layout")
    else:
        why = f"The simulator chose with {ours}; the run with {compiled.describe()}"
    return (f"{run}: plan {entry['label']!r} ({entry['passes']}): automatic choices differ: {options}. {why}. "
            "An automatic choice is the pass's cost model reading the topology's figures; with another choice the "
            "prediction is of another program than the one measured")
