"""LocMoE on 2 nodes x 2 ranks (4 gloo ranks on this machine): inter-node all-to-all bytes
per step, expert load max/mean, and the final training loss on pydoc_data.topics bytes, for
plain top-k, switch, hash and locality_gate (soft and hard), each with the flat and the
hierarchical all-to-all. Step times come from `commfx bench` (interleaved; see benchmarks/log/notebook-2026-11.md).

    .venv/bin/python benchmarks/locmoe.py --steps 300 --json benchmarks/locmoe.json

Bytes are exact (counted by the comm scheduler), whatever the CPU load. Every plan trains the
same model (same seed) on the same byte windows (same seed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROUTERS = {
    "plain top-2": "lift,expert_parallel",
    "switch (top-1)": "lift,locality_gate:gate=switch;mu=0,expert_parallel",
    "hash": "lift,locality_gate:gate=hash,expert_parallel",
    "locality_gate soft": "lift,locality_gate:max_nodes=0;max_remote_fraction=1;balance=0,expert_parallel",
    "locality_gate hard (defaults)": "lift,locality_gate,expert_parallel",
}
# Each router with the flat and the hierarchical all-to-all (lossless: same losses, fewer bytes).
PLANS = {**ROUTERS, **{f"{label} + hierarchical": f"{passes},hierarchical_a2a" for label, passes in ROUTERS.items()}}


def corpus_batches(steps: int, batch: int, seq: int, seed: int):
    import pydoc_data.topics
    import torch

    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq, (batch,), generator=g)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def worker(rank: int, world_size: int, passes: str, steps: int, batch: int, seq: int) -> dict:
    import torch

    from commfx.api import distribute
    from commfx.models.gpt_moe import build_gpt_moe
    from commfx.ops import locality, moe
    from commfx.plan import Plan
    from commfx.train import loss_fn
    from commfx.verify import split_batch

    loads: list = []
    layout = moe._dispatch_layout

    def counting_layout(indices, num_experts, capacity_factor):
        loads.append(torch.bincount(indices.reshape(-1), minlength=num_experts))
        return layout(indices, num_experts, capacity_factor)

    moe._dispatch_layout = counting_layout
    model, (example,) = build_gpt_moe(seed=0, batch=batch, seq=seq, vocab_size=256)
    plan = Plan.from_cli(passes, world_size=world_size, ranks_per_node=2)
    dm = distribute(model, plan, (split_batch(example, world_size, rank),))
    optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
    history = []
    for ids in corpus_batches(steps, batch, seq, seed=1):
        local = (split_batch(ids, world_size, rank),)
        dm.scheduler.stats.reset()
        loads.clear()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(dm(*local), local)
        loss.backward()
        optimizer.step()
        stats = dm.scheduler.stats.as_dict().get("all_to_all", {})
        history.append(
            {
                "loss": float(loss),
                "a2a_inter_node_bytes": stats.get("inter_node_bytes", 0),
                "loads": [l.tolist() for l in loads],
                "aux": {k: list(v) for k, v in locality.LAST_AUX_LOSSES.items()},
            }
        )
    return history


def summarize(ranks: list[list[dict]]) -> dict:
    steps = len(ranks[0])
    inter = [sum(r[s]["a2a_inter_node_bytes"] for r in ranks) for s in range(steps)]
    ratios = []
    for s in range(steps):
        for layer in range(len(ranks[0][s]["loads"])):
            load = [sum(r[s]["loads"][layer][e] for r in ranks) for e in range(len(ranks[0][s]["loads"][layer]))]
            ratios.append(max(load) / (sum(load) / len(load)))
    tail = max(1, steps // 10)
    final = sum(sum(r[s]["loss"] for r in ranks) / len(ranks) for s in range(steps - tail, steps)) / tail
    return {
        "a2a_inter_node_bytes_first_step": inter[0],
        "a2a_inter_node_bytes_mean": sum(inter) / steps,
        "load_max_over_mean": sum(ratios) / len(ratios),
        "final_loss (mean of last 10% of steps)": final,
        "aux_last": ranks[0][-1]["aux"],
    }


def main() -> None:
    from commfx.runtime.launcher import launch

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="run only the plans whose label contains one of these comma-separated words")
    parser.add_argument("--plan", action="append", default=[], metavar="LABEL=PASSES", help="an extra plan (repeatable)")
    args = parser.parse_args()
    plans = {**PLANS, **dict(p.split("=", 1) for p in args.plan)}
    if args.only:
        plans = {label: passes for label, passes in plans.items() if label == "plain top-2" or any(w in label for w in args.only.split(","))}
    sys.path.insert(0, str(Path(__file__).parent))
    results = {}
    for label, passes in plans.items():
        ranks = launch("locmoe:worker", 4, {"passes": passes, "steps": args.steps, "batch": args.batch, "seq": args.seq}, timeout_s=1200)
        results[label] = summarize(ranks)
        print(label, json.dumps(results[label]), flush=True)
    base = results["plain top-2"]
    print("\n| plan | inter-node a2a bytes/step (step 1) | mean | vs plain | load max/mean | final loss | vs plain |")
    print("|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(
            f"| {label} | {r['a2a_inter_node_bytes_first_step']:,} | {r['a2a_inter_node_bytes_mean']:,.0f} | "
            f"{r['a2a_inter_node_bytes_mean'] / base['a2a_inter_node_bytes_mean']:.2f}x | {r['load_max_over_mean']:.2f} | "
            f"{r['final_loss (mean of last 10% of steps)']:.4f} | "
            f"{r['final_loss (mean of last 10% of steps)'] / base['final_loss (mean of last 10% of steps)'] - 1:+.1%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
