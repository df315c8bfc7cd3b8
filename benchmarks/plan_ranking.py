"""`commfx plan`'s ranking against measurement: for each committed bench JSON, rank its commfx
plans by simulation (`search(..., candidates=...)` on the emulated cluster at the run's
layout and link) and compare the first choice with the best measured among the same plans.
Runs nothing on the network: the measured steps are the JSONs' medians.

Run: .venv/bin/python benchmarks/plan_ranking.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from commfx.bench.run_record import RunRecorder
from commfx.simulate import UNSUPPORTED, load_cluster
from commfx.simulate.search import Candidate, search
from commfx.simulate.validate import bench_model, layout_of

HERE = Path(__file__).resolve().parent
RUNS = [  # same model, layout and link within a run; several runs of the same plans are medians of medians
    ("Lina gpt-moe expert_hidden=1024, 2 x 1, 100 Mbit/s", ["peers_lina_gpt_moe_100mbit_2x1.json", "wire_bytes_lina_gpt_moe_100mbit_2x1.json",
                                                           "replacement_in_clock_lina_gpt_moe_100mbit_2x1_steps2.json"]),
    ("Lina gpt-moe expert_hidden=1024, 2 x 2, 100 Mbit/s", ["lina_100mbit.json"]),
    ("Lina Mixtral proportions, 2 x 1, 152 Mbit/s", ["peers_lina_mixtral_proportions_2x1.json"]),
    ("LocMoE top-1 gpt-moe, 2 x 1, 100 Mbit/s (dropless plans)", ["locmoe_top1_100mbit_2x1.json"]),
    ("ZeRO gpt-moe, 2 x 1, 1 Gbit/s (quiet rerun)", ["zero_gpt_moe_quiet_1gbit_2x1.json"]),
    ("Optimus-CC gpt-moe hidden 256, pp 2, 2 x 1, 100 Mbit/s", ["peers_optimus_cc_pipelining_quiet_100mbit_2x1.json"]),
]


def measured(files: list[str]) -> tuple[dict, dict[str, float], dict[str, dict]]:
    """(the first JSON's record, passes -> median of the runs' median steps, passes -> its
    pp/tp layout), commfx plans only."""
    steps: dict[str, list[float]] = {}
    layouts: dict[str, dict] = {}
    first = None
    for name in files:
        record = json.loads((HERE / name).read_text())
        first = first or record
        for plan in record["plans"]:
            passes = plan["passes"]
            if passes.startswith("peer:") or "capacity_factor" in passes or any(p in passes for p in UNSUPPORTED):
                continue
            steps.setdefault(passes, []).append(plan["wall"]["median_s"])
            layouts[passes] = layout_of(plan, record["world_size"])
    return first, {p: sorted(v)[len(v) // 2] for p, v in steps.items()}, layouts


def rank(title: str, files: list[str]) -> dict:
    record, steps, layouts = measured(files)
    cores = (record.get("machine") or {}).get("cpus")
    cluster = load_cluster("emulated").with_layout(record["nodes"], record["ranks_per_node"], record["inter_node_link"], cores)
    spec, kwargs = bench_model(record, HERE / files[0])
    candidates = [Candidate(p, pp=layouts[p].get("pp", 1), tp=layouts[p].get("tp", 1), precision=layouts[p].get("precision", "fp32"))
                  for p in steps]
    result = search(spec, cluster, memory_limit=float("inf"), model_kwargs=kwargs, candidates=candidates)
    predicted = {r.candidate.passes: r.step_s for r in result.ranked}
    order = [r.candidate.passes for r in result.ranked]
    chosen, best = order[0], min(steps, key=steps.get)
    return {
        "run": title, "files": files, "candidates": len(steps), "predicted_order": order,
        "measured_order": sorted(steps, key=steps.get), "predicted_s": predicted, "measured_s": steps,
        "chosen": chosen, "best_measured": best, "chosen_over_best_measured": steps[chosen] / steps[best],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args()
    recorder = RunRecorder(proportions="each run's own")
    rows = [rank(title, files) for title, files in RUNS]
    for row in rows:
        print(f"\n{row['run']} ({row['candidates']} candidates)")
        for p in row["predicted_order"]:
            print(f"  predicted {row['predicted_s'][p] * 1e3:7.1f} ms  measured {row['measured_s'][p] * 1e3:7.1f} ms  {p}")
        print(f"  first choice {row['chosen_over_best_measured']:.3f}x the best measured ({'within' if row['chosen_over_best_measured'] <= 1.05 else 'NOT within'} 5%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "run": recorder.finish()}, indent=2))


if __name__ == "__main__":
    main()
