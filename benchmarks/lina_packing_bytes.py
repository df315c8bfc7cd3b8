"""What the packed all-to-all of the Lina benchmark should send, counted from the routing.

    .venv/bin/python benchmarks/lina_packing_bytes.py benchmarks/lina_packed_100mbit_2x1.json

The benchmark (benchmarks/log/notebook-2026-11.md, 5b) runs `benchmarks/models/trained_router_moe.py:build` on 2
nodes x 1 rank: rank r routes its half of the held-out batch. A row crosses the inter-node
link for every (token, expert) pair whose expert lives on the other rank (plain expert
parallelism), or, with `pack_experts`, for every unique (token, other rank) pair: the
minimum for a placement. This script routes the batch with the trained model, fits the
placement the runtime fits from the same statistics (`solve_slots`, load bound 1.1 x mean),
and prints, per step and all ranks, the bytes of those rows times four (dispatch and
combine, forward and backward) beside the all-to-all bytes the bench measured. The measured
bytes also carry the routing metadata columns and the row counts; and the model trains
during the bench (a few AdamW steps), so its routing drifts a little from the one counted
here. Exact counts, no timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
import trained_router_moe  # noqa: E402

from commfx.runtime.placement import RoutingStats, slot_ranks, solve_slots  # noqa: E402

RANKS = 2
BYTES_PER_VALUE = 4  # float32 rows


def routing(model, batch: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's top-k expert ids, [tokens, k], tokens in batch order."""
    chosen = []
    hooks = [layer.moe.router.register_forward_hook(lambda r, a, out: chosen.append(out[1])) for layer in model.layers]
    with torch.no_grad():
        model(batch)
    for hook in hooks:
        hook.remove()
    return chosen


def remote_rows(ids: torch.Tensor, rank_of: torch.Tensor, token_rank: torch.Tensor, unique: bool) -> int:
    """Rows that leave their rank: (token, expert) pairs, or unique (token, rank) pairs."""
    dest = rank_of[ids]  # [tokens, k]
    remote = dest != token_rank[:, None]
    if not unique:
        return int(remote.sum())
    hit = torch.zeros(ids.shape[0], RANKS, dtype=torch.bool)
    hit.scatter_(1, dest, True)
    hit[torch.arange(ids.shape[0]), token_rank] = False
    return int(hit.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", nargs="?", help="a `commfx bench --json` result to compare with")
    args = parser.parse_args()
    model, (batch,) = trained_router_moe.build()
    hidden, experts = model.config.hidden_size, model.config.num_experts
    token_rank = torch.cat([torch.full((part.numel(),), r) for r, part in enumerate(torch.tensor_split(batch, RANKS))])
    contiguous = torch.arange(experts) // (experts // RANKS)
    rows = {"naive (token, expert) pairs": 0, "packed, contiguous placement": 0, "packed, fitted placement": 0}
    for ids in routing(model, batch):
        stats = RoutingStats(experts)
        stats.observe(ids)
        fitted = slot_ranks(solve_slots(stats, RANKS, torch.arange(experts), 0.1).slot_of, RANKS)
        rows["naive (token, expert) pairs"] += remote_rows(ids, contiguous, token_rank, unique=False)
        rows["packed, contiguous placement"] += remote_rows(ids, contiguous, token_rank, unique=True)
        rows["packed, fitted placement"] += remote_rows(ids, fitted, token_rank, unique=True)
        print(f"fitted placement (rank of each expert): {fitted.tolist()}")
    row_bytes = 4 * hidden * BYTES_PER_VALUE  # dispatch + combine, forward + backward
    for label, count in rows.items():
        print(f"{label:32s} {count:6d} remote rows/step -> {count * row_bytes:>10,d} B of a2a rows/step")
    if args.bench_json:
        plans = {p["label"]: p for p in json.loads(Path(args.bench_json).read_text())["plans"]}
        minimum = rows["packed, fitted placement"] * row_bytes
        naive_min = rows["naive (token, expert) pairs"] * row_bytes
        for label, plan in plans.items():
            measured = plan["bytes_per_step"].get("all_to_all", {}).get("inter_node_bytes", 0)
            print(f"bench {label:20s} a2a {measured:>12,.0f} B/step = {measured / minimum:.3f} x packed minimum, "
                  f"{measured / naive_min:.3f} x naive rows")


if __name__ == "__main__":
    main()
