"""Quality of Optimus-CC's compressed backward traffic: the same training run with and
without compression, and with and without lazy error propagation.

    .venv/bin/python benchmarks/pipeline_quality.py --steps 300 --rank 4 --json benchmarks/pipeline_quality.json
    .venv/bin/python benchmarks/pipeline_quality.py --steps 300 --rank 16 --hidden 256 --json benchmarks/pipeline_quality_r16_h256.json
    .venv/bin/python benchmarks/pipeline_quality.py --steps 300 --rank 4 --dp 2 --json benchmarks/pipeline_quality_dp2.json
    .venv/bin/python benchmarks/pipeline_quality.py --steps 300 --rank 16 --hidden 256 --expert-hidden 256 --batch 16 \
        --microbatches 2 --seeds 0,1,2 --json benchmarks/pipeline_quality_peer_model.json   # the model of the peer:pipelining run
    .venv/bin/python benchmarks/pipeline_quality.py --proportions gpt-2.5b --steps 300 --rank 16 --batch 16 \
        --microbatches 4 --seeds 0,1,2 --json benchmarks/pipeline_quality_gpt_2_5b_proportions.json

pp=2 on 2 local gloo ranks, gpt-moe with a byte vocabulary (256), hidden 128 (--hidden), 2 layers,
expert hidden 24 (--expert-hidden); --proportions gpt-2.5b: GPT-2.5B's widths scaled as
`commfx bench --proportions gpt-2.5b` builds it (dense: one expert; hidden 256, MLP 683, 4
layers), the byte vocabulary kept (the corpus is bytes); batches of 8 x 64 bytes of pydoc_data.topics (--batch;
consecutive, no repeats), 4 micro-batches (--microbatches),
1F1B, AdamW lr 3e-3, seed 0 (--seeds 0,1,2: each plan once per seed, model init and codec;
a plan's loss change is the mean over seeds of its ratio to the uncompressed run of the same
seed; --only NAME trains that plan beside the uncompressed one). Every plan trains the same model from the same start on the
same batches, one plan after another in the same processes. With --dp 2 (4 ranks, pp=2 x
dp=2; each dp rank takes half of every batch) the plans are Optimus-CC's selective stage
compression instead: stage 0's data-parallel all-reduce as PowerSGD factors. Losses are the mean of
the last 20 steps (the training loss on batches never seen before, so it is also held out).
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from commfx.bench.run_record import TOY, RunRecorder

PLANS = {
    "uncompressed": "lift,pipeline_split:microbatches={m}",
    "compressed, lazy error propagation": "lift,pipeline_split:microbatches={m},compress_pipeline:rank={r};epilogue_only=false",
    "compressed, no error feedback": "lift,pipeline_split:microbatches={m},compress_pipeline:rank={r};epilogue_only=false;error_feedback=false",
    "epilogue only, lazy error propagation": "lift,pipeline_split:microbatches={m},compress_pipeline:rank={r}",
    "epilogue only, no error feedback": "lift,pipeline_split:microbatches={m},compress_pipeline:rank={r};error_feedback=false",
}
PLANS_DP = {
    "uncompressed": "lift,pipeline_split:microbatches={m}",
    "selective: stage 0 dp all-reduce at rank r": "lift,pipeline_split:microbatches={m},compress_pipeline:boundaries=none;dp_stages=1;dp_rank={r}",
    "selective + epilogue-only boundary, rank r": "lift,pipeline_split:microbatches={m},compress_pipeline:rank={r};dp_stages=1;dp_rank={r}",
}


def corpus_batches(batch: int, seq: int, steps: int) -> torch.Tensor:
    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8", "replace")
    data = torch.tensor(list(text), dtype=torch.long)
    need = steps * batch * seq
    if need > data.numel():
        raise SystemExit(f"{steps} steps of {batch}x{seq} bytes need {need} bytes; the corpus has {data.numel()}")
    return data[:need].view(steps, batch, seq)


def worker(rank: int, world_size: int, steps: int, rank_r: int, hidden: int, dp: int = 1, batch: int = 8,
           microbatches: int = 4, expert_hidden: int = 24, seeds: tuple[int, ...] = (0,), only: tuple[str, ...] = (),
           model_kwargs: dict | None = None) -> dict:
    from commfx.api import distribute
    from commfx.models import build_gpt_moe
    from commfx.plan import Plan

    data = corpus_batches(batch, 64, steps)

    def loss_fn(logits, mb):
        ids = mb.inputs[0]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    rows = data.shape[1] // dp
    data = data[:, (rank % dp) * rows : (rank % dp + 1) * rows]  # this dp rank's half of each batch
    out = {}
    for (label, passes), seed in ((item, seed) for item in chosen_plans(dp, only).items() for seed in seeds):
        torch.manual_seed(seed)
        shape = {"hidden_size": hidden, "num_layers": 2, "expert_hidden": expert_hidden, **(model_kwargs or {})}
        model, _ = build_gpt_moe(**shape, vocab_size=256, max_seq=64, seed=seed)
        dm = distribute(model, Plan.from_cli(passes.format(r=rank_r, m=microbatches), world_size=2 * dp, pp=2), (data[0],))
        optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
        losses, backward_bytes, dp_bytes, start = [], 0, 0, time.perf_counter()
        for step in range(steps):
            dm.scheduler.stats.reset()
            optimizer.zero_grad(set_to_none=True)
            result = dm.step(data[step], loss_fn=loss_fn)
            optimizer.step()
            stats = dm.scheduler.stats
            backward_bytes += stats.intra_node_bytes["pp_backward"] + stats.inter_node_bytes["pp_backward"]
            dp_bytes += sum(stats.intra_node_bytes[k] + stats.inter_node_bytes[k] for k in ("grad_all_reduce", "grad_powersgd"))
            if result.loss is not None:
                losses.append(result.loss.item())
        out[f"{label}@{seed}"] = {"losses": losses, "backward_bytes": backward_bytes, "dp_bytes": dp_bytes, "seconds": time.perf_counter() - start}
    return out


def chosen_plans(dp: int, only: tuple[str, ...]) -> dict[str, str]:
    """The plans to train: all of the mode's, or those named by --only (the uncompressed one always)."""
    plans = PLANS_DP if dp > 1 else PLANS
    unknown = [name for name in only if name not in plans]
    if unknown:
        raise SystemExit(f"--only {unknown}: no such plan; known: {list(plans)}")
    return {label: passes for label, passes in plans.items() if not only or label == "uncompressed" or label in only}


def proportioned_model(args) -> dict | None:
    """--proportions: the bench's scaled model, its widths and depth in --hidden, --expert-hidden and the kwargs."""
    if not args.proportions:
        return None
    from commfx.bench.proportions import gpt_moe_kwargs, matched_link

    kwargs = gpt_moe_kwargs(matched_link(args.proportions, flops_per_rank=1.0, nodes=2, pp=2).model)
    args.hidden, args.expert_hidden = kwargs["hidden_size"], kwargs["expert_hidden"]
    return {k: v for k, v in kwargs.items() if k != "vocab_size"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="rows of 64 bytes a step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--expert-hidden", type=int, default=24)
    parser.add_argument("--dp", type=int, default=1, choices=(1, 2), help="2: pp=2 x dp=2 on 4 ranks, selective stage compression")
    parser.add_argument("--seeds", default="0", help="comma-separated: each plan trains once per seed (model init and codec)")
    parser.add_argument("--only", action="append", default=[], help="train this plan (repeatable; the uncompressed one always)")
    parser.add_argument("--proportions", choices=("gpt-2.5b",), default=None,
                        help="the model of `commfx bench --proportions gpt-2.5b` (sets --hidden and --expert-hidden), byte vocabulary")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_kwargs = proportioned_model(args)
    recorder = RunRecorder(proportions=args.proportions or TOY)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    sys.path.insert(0, str(Path(__file__).parent))
    from commfx.runtime.launcher import launch

    kwargs = {"steps": args.steps, "rank_r": args.rank, "hidden": args.hidden, "dp": args.dp, "batch": args.batch,
              "microbatches": args.microbatches, "expert_hidden": args.expert_hidden, "seeds": seeds, "only": tuple(args.only),
              "model_kwargs": model_kwargs}
    results = launch("pipeline_quality:worker", 2 * args.dp, kwargs, timeout_s=6 * 3600)
    first_stage, last_stages = results[0], results[args.dp :]  # ranks [0, dp): stage 0
    plans = chosen_plans(args.dp, tuple(args.only))
    # the global batch's loss: the mean over the last stage's dp ranks (equal halves), per plan and seed
    curves = {run: [sum(losses) / len(losses) for losses in zip(*(r[run]["losses"] for r in last_stages))] for run in results[0]}
    tail = min(20, args.steps)
    final = {run: sum(curve[-tail:]) / tail for run, curve in curves.items()}
    # bytes: the backward inter-stage bytes stage 1 -> 0 (pp only), or stage 0's dp all-reduce (dp 2)
    key, sender = ("dp_bytes", first_stage) if args.dp > 1 else ("backward_bytes", last_stages[0])
    rows = []
    for label in plans:
        # each seed against the uncompressed run of the same seed, then the mean over seeds
        ratios = [final[f"{label}@{seed}"] / final[f"uncompressed@{seed}"] - 1 for seed in seeds]
        losses = [final[f"{label}@{seed}"] for seed in seeds]
        sent = sender[f"{label}@{seeds[0]}"][key]
        rows.append(
            {
                "plan": label,
                "final_loss": statistics.fmean(losses),
                "final_loss_sd": statistics.stdev(losses) if len(seeds) > 1 else 0.0,
                "vs_uncompressed": statistics.fmean(ratios),
                "vs_uncompressed_per_seed": ratios,
                "seeds": list(seeds),
                key: sent,
                "bytes_ratio": sender[f"uncompressed@{seeds[0]}"][key] / max(sent, 1),
                "first_loss": curves[f"{label}@{seeds[0]}"][0],
                "seconds": max(r[f"{label}@{seed}"]["seconds"] for r in results for seed in seeds),
            }
        )
    what = "stage 0 dp all-reduce bytes" if args.dp > 1 else "backward bytes (stage 1 -> 0)"
    print(f"| plan (rank {args.rank}, {args.steps} steps, seeds {args.seeds}) | loss, mean of last 20 (± sd over seeds) "
          f"| vs uncompressed (mean over seeds) | {what} | fewer bytes |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['plan']} | {row['final_loss']:.4f} ± {row['final_loss_sd']:.4f} | {100 * row['vs_uncompressed']:+.2f}% "
              f"| {row[key]:,} | {row['bytes_ratio']:.1f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "curves": curves, "run": recorder.finish()}, indent=1))


if __name__ == "__main__":
    main()
