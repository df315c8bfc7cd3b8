"""LocMoE like for like (issue 30): top-1 routers on pydoc_data.topics bytes, several seeds.

For switch, hash, GrAP with locality and the model's scores with locality, every one top-1,
on NODES x RANKS_PER_NODE gloo ranks: inter-node all-to-all bytes per step, expert load
max/mean and the final training loss, per seed, then the mean and spread over seeds. Step
times come from `commfx bench` (interleaved; see benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/locmoe.py --model gpt-moe --seeds 0,1,2 --steps 300 \
        --json benchmarks/locmoe_top1_quality_gpt_moe.json

Models: `gpt-moe` (the built-in, top_k=1, hidden 32, 8 experts) and `qwen3-moe` (HF
Qwen3-MoE at Qwen3-30B-A3B's proportions scaled to hidden 128 by `bench/proportions.py`:
128 experts, expert width 0.375 x hidden; top_k=1 like every router here). `mixtral`: the
gpt-moe of `commfx bench --proportions mixtral-8x7b` at Mixtral's own top-2, where the
routers are the model's top-2 without locality (the base), and GrAP and the model's scores
with locality; `qwen3` and `olmoe` likewise at their top-8. All take a 256-byte vocabulary. Bytes are exact (counted by the comm scheduler), whatever the CPU
load. A seed fixes the model's weights and the byte windows; every router of one seed
trains the same model on the same windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROUTERS = {
    "switch": "lift,locality_gate:gate=switch;mu=0,expert_parallel",
    "hash": "lift,locality_gate:gate=hash,expert_parallel",
    "grap+locality": "lift,locality_gate:gate=grap,expert_parallel",
    "model+locality": "lift,locality_gate:gate=model,expert_parallel",
}
# The bench's gpt-moe at a --proportions preset and its own top-k: no top-1 baselines, the model's router is the base
AT_OWN_TOP_K = {"mixtral": "mixtral-8x7b", "qwen3": "qwen3-30b-a3b", "olmoe": "olmoe-1b-7b"}
ROUTERS_TOP_K = {
    "top-k, no locality": "lift,expert_parallel",
    "grap+locality": "lift,locality_gate:gate=grap,expert_parallel",
    "model+locality": "lift,locality_gate:gate=model,expert_parallel",
}
FINAL = "final_loss (mean of last 10% of steps)"


def corpus_batches(steps: int, batch: int, seq: int, seed: int):
    import pydoc_data.topics
    import torch

    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq, (batch,), generator=g)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def build_model(name: str, seed: int, batch: int, seq: int):
    """(model, example batch) of `name`, top-1, 256-byte vocabulary."""
    from commfx.models import load_model

    if name == "gpt-moe":
        return load_model("gpt-moe", seed=seed, batch=batch, seq=seq, vocab_size=256, top_k=1)
    if name == "qwen3-moe":
        from commfx.bench.proportions import REAL_MODELS, scaled

        m = scaled(REAL_MODELS["qwen3-30b-a3b"], hidden=128)
        return load_model(
            "hf:qwen3_moe", seed=seed, batch=batch, seq=seq, vocab_size=256, hidden_size=m.hidden,
            num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim, num_hidden_layers=m.layers,
            num_experts=m.experts, moe_intermediate_size=m.expert_hidden, num_experts_per_tok=1,
        )
    if name in AT_OWN_TOP_K:
        from commfx.bench.proportions import REAL_MODELS, gpt_moe_kwargs, scaled

        kwargs = gpt_moe_kwargs(scaled(REAL_MODELS[AT_OWN_TOP_K[name]])) | {"vocab_size": 256}
        return load_model("gpt-moe", seed=seed, batch=batch, seq=seq, **kwargs)
    raise ValueError(f"unknown model {name!r}: gpt-moe, qwen3-moe, {', '.join(AT_OWN_TOP_K)}")


def worker(rank: int, world_size: int, passes: str, model: str, seed: int, steps: int, batch: int, seq: int, ranks_per_node: int) -> list:
    import torch

    from commfx.api import distribute
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
    net, (example,) = build_model(model, seed, batch, seq)
    # The load counter above wraps the op's Python body, so the ops must run it: the
    # interpreter, not compiled regions (Inductor would trace the counter once, at compile).
    plan = dataclasses.replace(Plan.from_cli(passes, world_size=world_size, ranks_per_node=ranks_per_node), compute="interpret")
    dm = distribute(net, plan, (split_batch(example, world_size, rank),))
    optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
    history = []
    for ids in corpus_batches(steps, batch, seq, seed=1000 + seed):
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
        FINAL: final,
        "aux_last": ranks[0][-1]["aux"],
    }


def over_seeds(runs: dict[int, dict]) -> dict:
    """Mean and spread (min, max, sample standard deviation) over seeds of each figure."""
    out = {}
    for key in ("a2a_inter_node_bytes_mean", "load_max_over_mean", FINAL):
        values = [r[key] for r in runs.values()]
        out[key] = {
            "mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "per_seed": values,
        }
    return out


def table(results: dict, base: str) -> str:
    """Markdown: each router against `base` (bytes and loss: means over seeds)."""
    b = results[base]["over_seeds"]
    lines = [
        f"| router | inter-node a2a B/step | vs {base} | load max/mean | final loss mean ± sd [min–max] | vs {base} |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        s = r["over_seeds"]
        loss = s[FINAL]
        lines.append(
            f"| {label} | {s['a2a_inter_node_bytes_mean']['mean']:,.0f} | "
            f"{s['a2a_inter_node_bytes_mean']['mean'] / b['a2a_inter_node_bytes_mean']['mean']:.2f}x | "
            f"{s['load_max_over_mean']['mean']:.2f} | {loss['mean']:.4f} ± {loss['stdev']:.4f} [{loss['min']:.4f}–{loss['max']:.4f}] | "
            f"{loss['mean'] / b[FINAL]['mean'] - 1:+.2%} |"
        )
    return "\n".join(lines)


def main() -> None:
    from commfx.bench.run_record import TOY, RunRecorder
    from commfx.runtime.launcher import launch

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-moe", choices=("gpt-moe", "qwen3-moe", *AT_OWN_TOP_K))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (model weights and byte windows)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="run only these comma-separated labels, in this order (the base, switch or "
                                                  "top-k, always runs, first)")
    parser.add_argument("--plan", action="append", default=[], metavar="LABEL=PASSES", help="an extra plan (repeatable)")
    args = parser.parse_args()
    recorder = RunRecorder(proportions={"qwen3-moe": "qwen3-30b-a3b", **AT_OWN_TOP_K}.get(args.model, TOY))
    routers = ROUTERS_TOP_K if args.model in AT_OWN_TOP_K else ROUTERS
    base = next(iter(routers))
    plans = {**routers, **dict(p.split("=", 1) for p in args.plan)}
    if args.only:
        plans = {label: plans[label] for label in dict.fromkeys([base, *args.only.split(",")])}
    seeds = [int(s) for s in args.seeds.split(",")]
    world = args.nodes * args.ranks_per_node
    sys.path.insert(0, str(Path(__file__).parent))
    results = {}
    config = {k: getattr(args, k) for k in ("model", "steps", "batch", "seq", "nodes", "ranks_per_node")} | {"seeds": seeds}
    for label, passes in plans.items():
        runs = {}
        for seed in seeds:
            kwargs = {"passes": passes, "model": args.model, "seed": seed, "steps": args.steps, "batch": args.batch,
                      "seq": args.seq, "ranks_per_node": args.ranks_per_node}
            runs[seed] = summarize(launch("locmoe:worker", world, kwargs, timeout_s=3600))
            print(label, seed, json.dumps({k: v for k, v in runs[seed].items() if k != "aux_last"}), flush=True)
        results[label] = {"passes": passes, "per_seed": runs, "over_seeds": over_seeds(runs)}
        if args.json:  # after every router, so a cut run keeps what it measured
            Path(args.json).write_text(json.dumps({"config": config, "results": results, "run": recorder.finish()}, indent=1))
    print()
    print(table(results, base))


if __name__ == "__main__":
    main()
