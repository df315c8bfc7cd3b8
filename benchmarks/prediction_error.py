"""`commfx simulate`'s prediction error on the bench runs RESULTS.md cites, out of sample:
the runs the emulated preset was fitted to (its `fitted_to`) are left out. Each commfx plan
of the others is simulated on the emulated cluster at its run's layout and link, compiled
with the cost models' figures the run compiled with (so with its automatic choices; a run
whose recorded choices the simulator does not reproduce is listed and left out, and the
script exits 1), against the run's measured median step, and each plan's ratio to its run's
first simulated plan. Runs nothing on the network; peers and plans the simulator does not
model are listed as skipped.

Run: .venv/bin/python benchmarks/prediction_error.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from commfx.bench.run_record import RunRecorder
from commfx.simulate import load_cluster
from commfx.simulate.validate import ChoiceMismatch, validate

HERE = Path(__file__).resolve().parent
# Runs from before the bench recorded each plan's precision, as RESULTS.md's commands ran them
PRECISION = {"mixed_precision_lina_bf16_100mbit_2x1.json": "bf16"}
# The cost models' figures of runs that recorded neither them nor a measurement, as their
# commands (benchmarks/run_bench.sh) set them: {} is the bench topology as written, its link set
GIVEN = {"peers_embrace_gpt2_proportions_100mbit_2x1.json": {}}


def cited_runs() -> list[Path]:
    """The `commfx bench --json` files RESULTS.md names (others there are not bench runs)."""
    names = sorted(set(re.findall(r"[a-z0-9_]+\.json", (HERE / "RESULTS.md").read_text())))
    runs = []
    for name in names:
        path = HERE / name
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and "plans" in record and record.get("inter_node_link"):
            runs.append(path)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every comparison here")
    args = parser.parse_args()
    recorder = RunRecorder(proportions="each run's own")
    cluster = load_cluster("emulated")
    runs = cited_runs()
    fitted = [p.name for p in runs if p.name in cluster.fitted_to]
    rows, skipped, mismatched = [], [], []
    for path in runs:
        if path.name in fitted:
            continue
        try:
            comparisons, passed_over = validate(path, cluster, precision=PRECISION.get(path.name, "fp32"), given=GIVEN.get(path.name))
        except ChoiceMismatch as error:
            mismatched.append(str(error))
            print(f"AUTOMATIC CHOICES DIFFER, run left out: {error}")
            continue
        skipped += [f"{path.name}: {s}" for s in passed_over]
        for c in comparisons:
            rows.append({"run": path.name, **c.as_dict()})
            print(f"{path.name:52s} {c.label:22s} measured {c.measured_s * 1e3:8.1f} ms  predicted {c.predicted_s * 1e3:8.1f} ms"
                  f"  {c.step_error:+6.1%}  ratio {c.measured_ratio:5.2f} -> {c.predicted_ratio:5.2f} ({c.ratio_error:+6.1%})")
    steps = [abs(r["step_error"]) for r in rows]
    ratios = [abs(r["ratio_error"]) for r in rows if r["measured_ratio"] != 1.0 or r["predicted_ratio"] != 1.0]
    summary = {
        "plans": len(rows), "runs": len({r["run"] for r in rows}), "fitted_runs": fitted, "mismatched_runs": len(mismatched),
        "choices_checked": sum(1 for r in rows if set(r["choices"]) - set(r["unchecked"])),
        "choices_not_recorded": sum(1 for r in rows if r["unchecked"]),
        "step_error_median": statistics.median(steps), "step_error_worst": max(steps),
        "within_15_percent": sum(e <= 0.15 for e in steps),
        "ratio_error_median": statistics.median(ratios), "ratio_error_worst": max(ratios), "ratios": len(ratios),
        "ratios_within_10_percent": sum(e <= 0.10 for e in ratios),
    }
    print(f"\nleft out, the preset was fitted to them: {', '.join(fitted) or 'none'}")
    print(f"{summary['plans']} plans of {summary['runs']} runs: step error median {summary['step_error_median']:.1%}, worst {summary['step_error_worst']:.1%}, "
          f"{summary['within_15_percent']} within 15%; ratio error median {summary['ratio_error_median']:.1%}, "
          f"worst {summary['ratio_error_worst']:.1%}, {summary['ratios_within_10_percent']} of {summary['ratios']} within 10%")
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "comparisons": rows, "skipped": skipped, "mismatched": mismatched,
                                               "run": recorder.finish()}, indent=2))
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
