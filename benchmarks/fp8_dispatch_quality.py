"""fp8 dispatch against bf16 dispatch (issue 31, item 3): training loss on pydoc_data.topics
bytes and all-to-all bytes per step, both under --precision bf16, several seeds.

    nice -n 10 timeout 2400 .venv/bin/python benchmarks/fp8_dispatch_quality.py --seeds 0,1,2 --steps 300 \
        --json benchmarks/fp8_dispatch_quality.json

Model: the built-in gpt-moe at the bench preset's widths (hidden 128: one scale block per
row; expert hidden 256, 8 experts, top-2, 2 layers), a 256-byte vocabulary. Batches are
random windows of the corpus (locmoe.py's `corpus_batches`); a seed fixes the weights and
the windows, and both plans of one seed train the same model on the same windows. Bytes
are the comm scheduler's exact counts (all all-to-alls of a step: counts, dispatch,
combine, their backward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from commfx.bench.run_record import RunRecorder

PLANS = {
    "bf16 dispatch": "lift,expert_parallel",
    "fp8 dispatch": "lift,expert_parallel:dispatch=fp8",
}
FINAL = "final_loss (mean of last 10% of steps)"


def worker(rank: int, world_size: int, passes: str, seed: int, steps: int, batch: int, seq: int, lr: float) -> list:
    import dataclasses

    import torch

    from commfx.api import distribute
    from commfx.models import load_model
    from commfx.plan import Plan
    from commfx.train import loss_fn
    from commfx.verify import split_batch
    from locmoe import corpus_batches

    net, (example,) = load_model(
        "gpt-moe", seed=seed, batch=batch, seq=seq, vocab_size=256, hidden_size=128, num_heads=4, num_layers=2,
        num_experts=8, top_k=2, expert_hidden=256,
    )
    plan = dataclasses.replace(Plan.from_cli(passes, world_size=world_size), precision="bf16")
    dm = distribute(net, plan, (split_batch(example, world_size, rank),))
    optimizer = torch.optim.AdamW(dm.parameters(), lr=lr)
    history = []
    for ids in corpus_batches(steps, batch, seq, seed=1000 + seed):
        local = (split_batch(ids, world_size, rank),)
        dm.scheduler.stats.reset()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(dm(*local), local)
        loss.backward()
        optimizer.step()
        stats = dm.scheduler.stats.as_dict().get("all_to_all", {})
        history.append({"loss": float(loss), "a2a_bytes": stats.get("intra_node_bytes", 0) + stats.get("inter_node_bytes", 0)})
    return history


def summarize(ranks: list[list[dict]]) -> dict:
    steps = len(ranks[0])
    tail = max(1, steps // 10)
    losses = [sum(r[s]["loss"] for r in ranks) / len(ranks) for s in range(steps)]
    return {
        FINAL: sum(losses[-tail:]) / tail,
        "a2a_bytes_per_step": sum(sum(r[s]["a2a_bytes"] for r in ranks) for s in range(steps)) / steps,
        "loss_curve_every_30": losses[::30],
    }


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "per_seed": values}


def main() -> None:
    from commfx.runtime.launcher import launch

    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    recorder = RunRecorder()
    seeds = [int(s) for s in args.seeds.split(",")]
    sys.path.insert(0, str(Path(__file__).parent))
    config = {k: getattr(args, k) for k in ("steps", "batch", "seq", "lr", "world_size")} | {"seeds": seeds, "precision": "bf16"}
    results: dict = {label: {"passes": passes, "per_seed": {}} for label, passes in PLANS.items()}
    for seed in seeds:  # seed-major: a cut run keeps complete pairs
        for label, passes in PLANS.items():
            kwargs = {"passes": passes, "seed": seed, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr}
            run = summarize(launch("fp8_dispatch_quality:worker", args.world_size, kwargs, timeout_s=3600))
            results[label]["per_seed"][seed] = run
            print(label, seed, json.dumps({k: v for k, v in run.items() if k != "loss_curve_every_30"}), flush=True)
        for label in PLANS:
            runs = results[label]["per_seed"].values()
            results[label]["over_seeds"] = {k: spread([r[k] for r in runs]) for k in (FINAL, "a2a_bytes_per_step")}
        base, fp8 = (results[label]["per_seed"] for label in PLANS)
        results["fp8 vs bf16"] = {
            "final_loss_relative_per_seed": {s: fp8[s][FINAL] / base[s][FINAL] - 1 for s in fp8},
            "a2a_bytes_ratio": results["fp8 dispatch"]["over_seeds"]["a2a_bytes_per_step"]["mean"]
            / results["bf16 dispatch"]["over_seeds"]["a2a_bytes_per_step"]["mean"],
        }
        if args.json:
            Path(args.json).write_text(json.dumps({"config": config, "results": results, "run": recorder.finish()}, indent=1))
    print(json.dumps(results["fp8 vs bf16"], indent=1))


if __name__ == "__main__":
    main()
