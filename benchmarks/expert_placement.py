"""How many dispatch rows expert placement by affinity saves, on a router trained on real text.

    .venv/bin/python benchmarks/expert_placement.py --steps 300

Trains the built-in gpt-moe (byte vocabulary, hidden 64, 2 layers, 8 experts, top-2) in one
process on consecutive 8 x 64-byte batches of pydoc_data.topics (AdamW, lr 3e-3, seed 0),
then routes 40 further batches it has not seen. Routing statistics of the first 20 fit a
placement per layer (`commfx.runtime.placement.solve_placement`, load bound 1.1 and 1.5 x mean);
the last 20 are held out and counted: rows packed dispatch sends (unique (token, rank)
pairs) with expert_parallel's contiguous layout and with the fitted one, beside the rows
plain expert parallelism sends (tokens x k), and with a placement that balances load alone
(longest processing time first), to separate what affinity buys from what balance costs. Exact counts, no timing: the machine's load
does not matter.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
from pathlib import Path

import torch
import torch.nn.functional as F

from commfx.bench.run_record import RunRecorder
from commfx.models import build_gpt_moe
from commfx.runtime.placement import RoutingStats, balanced_placement, contiguous_placement, dispatch_rows, solve_placement

BATCH, SEQ = 8, 64


def corpus(batches: int) -> torch.Tensor:
    data = torch.tensor(list("".join(pydoc_data.topics.topics.values()).encode("utf-8")), dtype=torch.long)
    need = batches * BATCH * SEQ
    if need > data.numel():
        raise SystemExit(f"{batches} batches of {BATCH}x{SEQ} bytes need {need} bytes; the corpus has {data.numel()}")
    return data[:need].view(batches, BATCH, SEQ)


def routing_of(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's top-k expert ids for one batch, [tokens, k], read by forward hooks."""
    seen: list[torch.Tensor] = []
    hooks = [layer.moe.router.register_forward_hook(lambda m, i, out: seen.append(out[1].reshape(-1, out[1].shape[-1]))) for layer in model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--epsilon", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    recorder = RunRecorder()

    torch.manual_seed(0)
    model, _ = build_gpt_moe(vocab_size=256, hidden_size=64, num_layers=2, num_experts=8, top_k=2, max_seq=SEQ, seed=0)
    data = corpus(args.steps + 40)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        ids = data[step]
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(f"trained {args.steps} steps, last loss {loss.item():.3f}")

    fit = [routing_of(model, data[args.steps + i]) for i in range(20)]
    held_out = [routing_of(model, data[args.steps + 20 + i]) for i in range(20)]
    rows = []
    for layer in range(len(model.layers)):
        stats = RoutingStats(8)
        for batch in fit:
            stats.observe(batch[layer])
        test = torch.cat([batch[layer] for batch in held_out])
        test_stats = RoutingStats(8)
        test_stats.observe(test)
        for ranks, epsilon in [(r, e) for r in (2, 4) for e in args.epsilon]:
            placed = solve_placement(stats, ranks, epsilon)
            contiguous = contiguous_placement(8, ranks)
            balanced = balanced_placement(stats.load, ranks)
            plain = test.numel()
            row = {
                "layer": layer,
                "ranks": ranks,
                "epsilon": epsilon,
                "plain_ep_rows": plain,
                "packed_contiguous_rows": dispatch_rows(test, contiguous),
                "packed_balanced_rows": dispatch_rows(test, balanced),
                "packed_affinity_rows": dispatch_rows(test, placed),
                "placement": [placed.experts_of(r) for r in range(ranks)],
                "max_load_over_mean_contiguous": max(contiguous.loads(test_stats.load)) / (float(test_stats.load.sum()) / ranks),
                "max_load_over_mean_balanced": max(balanced.loads(test_stats.load)) / (float(test_stats.load.sum()) / ranks),
                "max_load_over_mean_affinity": max(placed.loads(test_stats.load)) / (float(test_stats.load.sum()) / ranks),
            }
            rows.append(row)

    print("| layer | ranks | load bound | plain EP rows | packed: contiguous | packed: balanced only | packed: affinity | affinity / balanced | load max/mean: contiguous, balanced, affinity | placement |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['ranks']} | {1 + r['epsilon']:.1f} x mean | {r['plain_ep_rows']:,} | {r['packed_contiguous_rows']:,} | "
            f"{r['packed_balanced_rows']:,} | {r['packed_affinity_rows']:,} | {r['packed_affinity_rows'] / r['packed_balanced_rows']:.3f} | "
            f"{r['max_load_over_mean_contiguous']:.2f}, {r['max_load_over_mean_balanced']:.2f}, {r['max_load_over_mean_affinity']:.2f} | {r['placement']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "run": recorder.finish()}, indent=1))


if __name__ == "__main__":
    main()
