"""`commfx simulate`'s prediction error on every commfx plan of the bench runs RESULTS.md cites:
each plan simulated on the emulated cluster at its run's layout and link, against the run's
measured median step, and each plan's ratio to its run's first simulated plan. Runs nothing
on the network; peers and plans the simulator does not model are listed as skipped.

Run: .venv/bin/python benchmarks/prediction_error.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from commfx.bench.run_record import RunRecorder
from commfx.simulate.validate import validate

HERE = Path(__file__).resolve().parent
# Runs from before the bench recorded each plan's precision, as RESULTS.md's commands ran them
PRECISION = {"mixed_precision_lina_bf16_100mbit_2x1.json": "bf16"}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every comparison here")
    args = parser.parse_args()
    recorder = RunRecorder(proportions="each run's own")
    rows, skipped = [], []
    for path in cited_runs():
        comparisons, passed_over = validate(path, precision=PRECISION.get(path.name, "fp32"))
        skipped += [f"{path.name}: {s}" for s in passed_over]
        for c in comparisons:
            rows.append({"run": path.name, **c.as_dict()})
            print(f"{path.name:52s} {c.label:22s} measured {c.measured_s * 1e3:8.1f} ms  predicted {c.predicted_s * 1e3:8.1f} ms"
                  f"  {c.step_error:+6.1%}  ratio {c.measured_ratio:5.2f} -> {c.predicted_ratio:5.2f} ({c.ratio_error:+6.1%})")
    steps = [abs(r["step_error"]) for r in rows]
    ratios = [abs(r["ratio_error"]) for r in rows if r["measured_ratio"] != 1.0 or r["predicted_ratio"] != 1.0]
    summary = {
        "plans": len(rows), "step_error_median": statistics.median(steps), "step_error_worst": max(steps),
        "within_15_percent": sum(e <= 0.15 for e in steps),
        "ratio_error_median": statistics.median(ratios), "ratio_error_worst": max(ratios), "ratios": len(ratios),
        "ratios_within_10_percent": sum(e <= 0.10 for e in ratios),
    }
    print(f"\n{summary['plans']} plans: step error median {summary['step_error_median']:.1%}, worst {summary['step_error_worst']:.1%}, "
          f"{summary['within_15_percent']} within 15%; ratio error median {summary['ratio_error_median']:.1%}, "
          f"worst {summary['ratio_error_worst']:.1%}, {summary['ratios_within_10_percent']} of {summary['ratios']} within 10%")
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "comparisons": rows, "skipped": skipped, "run": recorder.finish()}, indent=2))


if __name__ == "__main__":
    main()
