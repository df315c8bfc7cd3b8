"""A training step at world 1 on this CPU: commfx's compiled regions against the interpreter,
eager PyTorch and torch.compile (Inductor) of the plain model (issue 42, item 3).

    .venv/bin/python benchmarks/compute_world1.py                  # gpt-moe and the Mixtral-shaped model
    .venv/bin/python benchmarks/compute_world1.py --models gpt-moe --rounds 13

One process, one gloo rank; each variant trains its own copy of the same model with AdamW
(`lift,expert_parallel` for commfx; HF's own loop over experts for eager and torch.compile). The variants run in interleaved rounds (one step of each
per round), so load from other processes falls on all alike; the first `--warmup` rounds
(compiling included) are dropped and the median of the rest is reported, with the median of
the per-round ratios to torch.compile. Writes benchmarks/compute_world1.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import commfx
from commfx.bench.run_record import RunRecorder
from commfx.models import load_model
from commfx.plan import Plan
from commfx.train import loss_fn

# The CPU row: hidden 256, 4 layers, 8 experts top-2, vocabulary 8,192, batch 4 x 256.
MIXTRAL = dict(
    hidden_size=256, intermediate_size=896, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    num_local_experts=8, num_experts_per_tok=2, vocab_size=8192, batch=4, seq=256,
)
# Qwen3-30B-A3B's and OLMoE-1B-7B's proportions at that width: expert hidden 0.375 and 0.5 of
# the hidden size, 32 experts top-4 (the Qwen3-shaped row) and 64 experts top-8.
QWEN3_MOE = dict(
    hidden_size=256, moe_intermediate_size=96, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4, vocab_size=8192, batch=4, seq=256,
)
OLMOE = dict(
    hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
    num_experts=64, num_experts_per_tok=8, vocab_size=8192, batch=4, seq=256,
)
PROPORTIONS = {"gpt-moe": "toy", "mixtral-256": "mixtral-8x7b (hidden 256)", "qwen3-moe-256": "qwen3-30b-a3b (hidden 256)",
               "olmoe-256": "olmoe-1b-7b (hidden 256)"}
MODELS = {"gpt-moe": ("gpt-moe", {}), "mixtral-256": ("hf:mixtral", MIXTRAL), "qwen3-moe-256": ("hf:qwen3_moe", QWEN3_MOE),
          "olmoe-256": ("hf:olmoe", OLMOE)}
PASSES = "lift,expert_parallel"


def _loop_experts(model) -> None:
    """HF experts as transformers' loop over experts: batched_mm (what capture picks on the
    CPU) copies the weights per token row, 18 GB at the Mixtral-shaped size."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")


def _step_fn(name: str, spec: str, kwargs: dict):
    """(seconds it took to build, a function running one AdamW training step) for a variant."""
    model, inputs = load_model(spec, seed=0, **kwargs)
    start = time.perf_counter()
    if name.startswith("commfx"):
        plan = dataclasses.replace(Plan.from_cli(PASSES, world_size=1), compute=name.split("-", 1)[1])
        # Captured on two sequences (the graph is batch-symbolic; the step lowers the full batch):
        # capture runs the model once with HF's batched_mm experts, 18 GB at the full batch.
        run = commfx.distribute(model, plan, tuple(t[:2] for t in inputs))
        params = list(run.parameters())
    elif name == "torch.compile":
        _loop_experts(model)
        run, params = torch.compile(model), list(model.parameters())
    else:
        _loop_experts(model)
        run, params = model, list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if hasattr(run, "attach_optimizer"):
        run.attach_optimizer(optimizer)

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = run(*inputs)
        loss_fn(out, inputs).backward()
        optimizer.step()

    return time.perf_counter() - start, step, run


def measure(model: str, rounds: int, warmup: int) -> dict:
    spec, kwargs = MODELS[model]
    variants = ["eager", "torch.compile", "commfx-interpret", "commfx-inductor"]
    steps, times, first, notes = {}, {v: [] for v in variants}, {}, {}
    for name in variants:
        build_s, steps[name], run = _step_fn(name, spec, kwargs)
        start = time.perf_counter()
        steps[name]()  # the first step compiles (torch.compile, commfx's lowering and regions)
        first[name] = build_s + time.perf_counter() - start
        note = getattr(run, "compile_note", lambda: None)()
        if note:
            notes[name] = note
    for index in range(rounds):
        for name in variants:
            start = time.perf_counter()
            steps[name]()
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratios = {
        name: statistics.median(a / b for a, b in zip(times[name], times["torch.compile"]))
        for name in variants
    }
    return {"model": model, "config": kwargs, "passes": PASSES, "median_ms": median, "ratio_to_compile": ratios,
            "first_step_s": first, "compile_notes": notes, "rounds": rounds, "warmup": warmup}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral-256,qwen3-moe-256,olmoe-256")
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=str(Path(__file__).parent / "compute_world1.json"))
    args = parser.parse_args(argv)
    recorder = RunRecorder(proportions=", ".join(PROPORTIONS[m] for m in args.models.split(",")))
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    results = []
    for model in args.models.split(","):
        result = measure(model, args.rounds, args.warmup)
        results.append(result)
        print(f"{model}: median of {args.rounds - args.warmup} steps after {args.warmup} warm-ups (ms; x torch.compile, median of per-round ratios)")
        for name, ms in result["median_ms"].items():
            print(f"  {name:<17} {ms:8.1f} ms  {result['ratio_to_compile'][name]:.2f}x   first step {result['first_step_s'][name]:.1f} s")
        for name, note in result["compile_notes"].items():
            print(f"  {name}: {note}")
        sys.stdout.flush()
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results, "run": recorder.finish()}, f, indent=2)
    print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
