"""Embedding bytes per step: dense all-reduce vs split_embedding_comm's strategies (EmbRace).

Model: the built-in gpt-moe with an untied 50,000-word vocabulary (hidden 64, 2 layers,
4 experts), expert parallel over 2 ranks, each rank its own node (ranks_per_node=1, so
every byte counts as inter-node). Tokens: words of Python's own documentation
(pydoc_data.topics), the 49,999 most frequent as ids and the rest as one unknown id, so
ids follow real word frequencies; each rank's batch is 8 windows of 64 words.

Bytes are the comm scheduler's exact counts of what every rank sent, summed over ranks
and averaged over the steps: independent of CPU load and link speed. A table kept
dense counts its share of the gradient all-reduce (a plan's all-reduce bytes minus the
sparse plan's, which all-reduces no table; for the dense plan this equals the ring formula).

    .venv/bin/python benchmarks/embedding_bytes.py [--steps 4] [--world-size 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from embrace_models import corpus_ids

VOCAB, HIDDEN, SEQ, ROWS_PER_RANK = 50_000, 64, 64, 8
PLANS = {
    "dense all-reduce": "lift,expert_parallel",
    "sparse pairs (b)": "lift,expert_parallel,split_embedding_comm:strategy=sparse",
    "row-sharded (a)": "lift,expert_parallel,split_embedding_comm:strategy=shard",
    "auto": "lift,expert_parallel,split_embedding_comm",
}


def batches(world_size: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    ids = corpus_ids()
    generator = torch.Generator().manual_seed(seed)
    rows = ROWS_PER_RANK * world_size
    out = []
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - SEQ, (rows,), generator=generator)
        out.append(torch.stack([ids[s : s + SEQ] for s in starts.tolist()]))
    return out


def measure(rank: int, world_size: int, passes: str, steps: int) -> dict:
    from commfx.api import distribute
    from commfx.models import load_model
    from commfx.plan import Plan
    from commfx.verify import split_batch

    model, _ = load_model("gpt-moe", vocab_size=VOCAB, hidden_size=HIDDEN, num_experts=4, expert_hidden=64, max_seq=SEQ)
    data = batches(world_size, steps)
    plan = Plan.from_cli(passes, world_size=world_size, ranks_per_node=1)
    dm = distribute(model, plan, (split_batch(data[0], world_size, rank),))
    optimizer = torch.optim.AdamW(dm.parameters(), lr=1e-3)
    per_step, unique = [], []
    for batch in data:
        local = split_batch(batch, world_size, rank)
        unique.append(int(local.unique().numel()))
        dm.scheduler.stats.reset()
        optimizer.zero_grad(set_to_none=True)
        logits = dm(local)
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), local.reshape(-1)).backward()
        optimizer.step()
        per_step.append(dm.scheduler.stats.as_dict())
    decisions = {k: v["strategy"] for k, v in dm.program.decisions.get("split_embedding_comm", {}).items()}
    return {"stats": per_step, "unique": unique, "decisions": decisions}


def sent(stats: dict, kind: str) -> int:
    entry = stats.get(kind, {})
    return entry.get("intra_node_bytes", 0) + entry.get("inter_node_bytes", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from commfx.runtime.launcher import launch

    rows = {}
    for label, passes in PLANS.items():
        results = launch("embedding_bytes:measure", args.world_size, {"passes": passes, "steps": args.steps}, timeout_s=900)
        steps = range(args.steps)
        rows[label] = {
            "embedding": sum(sent(r["stats"][s], "embedding_all_to_all") for r in results for s in steps) / args.steps,
            "grad_all_reduce": sum(sent(r["stats"][s], "grad_all_reduce") for r in results for s in steps) / args.steps,
            "all_to_all": sum(sent(r["stats"][s], "all_to_all") for r in results for s in steps) / args.steps,
            "decisions": results[0]["decisions"],
            "unique": [r["unique"] for r in results],
        }
    # Everything but the tables is all-reduced alike in every plan; the sparse plan all-reduces
    # no table, so anything a plan all-reduces beyond it is a table kept dense.
    others = rows["sparse pairs (b)"]["grad_all_reduce"]
    for row in rows.values():
        row["embedding"] += row["grad_all_reduce"] - others
    dense_tables = rows["dense all-reduce"]["embedding"]
    ring = args.world_size * 2 * (args.world_size - 1) * (VOCAB + SEQ) * HIDDEN * 4 // args.world_size
    print(f"world {args.world_size}, {ROWS_PER_RANK * SEQ} tokens per rank, unique ids per rank and step: {rows['auto']['unique']}")
    print(f"dense tables' share of the all-reduce: {dense_tables:,.0f} B/step (ring formula: {ring:,} B)")
    print("| plan | strategy per table | embedding bytes/step (all ranks) | vs dense | other parameters' all-reduce | MoE all-to-all |")
    print("|---|---|---:|---:|---:|---:|")
    for label, row in rows.items():
        other = others
        factor = dense_tables / row["embedding"] if row["embedding"] else float("inf")
        decisions = ", ".join(f"{k}: {v}" for k, v in row["decisions"].items()) or "embed.weight, pos.weight: dense"
        print(f"| {label} | {decisions} | {row['embedding']:,.0f} | {factor:.1f}x fewer | {other:,.0f} | {row['all_to_all']:,.0f} |")


if __name__ == "__main__":
    main()
