"""Peak memory of one training step at world 1: eager PyTorch against commfx, with and without
an activation memory budget (issue 42, item 5: commfx at most eager's + 5%).

    .venv/bin/python benchmarks/memory_world1.py                    # gpt-moe, compiled regions, budget 0.1
    .venv/bin/python benchmarks/memory_world1.py --budgets 0.5,0.1 --steps 3
    .venv/bin/python benchmarks/memory_world1.py --quick            # interpreted graphs, one warm-up step: checks the script
    .venv/bin/python benchmarks/memory_world1.py --device cuda

Each variant runs in its own process (a fresh allocator): the built-in model, AdamW, `--steps`
warm-up steps (commfx compiles in the first), then the measured step (zero_grad, forward,
next-token loss, backward, optimizer step). Eager runs the built-in experts as one grouped
matmul (`grouped_experts`, not the per-row weight gather a trace records); commfx runs
`lift,expert_parallel` on a gloo (NCCL on cuda) group of one.

What is measured. On cuda: `torch.cuda.max_memory_allocated` over the step (the caching
allocator's live bytes, exact). On the CPU there are no allocator statistics, so two figures:
- `peak_bytes`: the CPU allocator's running total of live tensor bytes as the torch profiler
  reports it (profile_memory=True; each allocation event carries the total), profiled from
  before the model is built, so it is absolute; the peak is the largest total inside the
  measured step. The profiler sees the training thread's allocations only: buffers a commfx
  collective allocates on its dispatcher thread are missed (at world 1 its all-to-alls move
  nothing across ranks).
- `rss_growth_bytes`: the process's peak resident set over a further, unprofiled step above
  its resident set before it (/proc/self/clear_refs resets the high-water mark, VmHWM reads
  it): every thread and the allocator's own caching included, Python objects too; noisier.
Writes benchmarks/memory_world1.json (or --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

PASSES = "lift,expert_parallel"
MARK = "measured_step"


def variants(budgets: list[float]) -> list[str]:
    return ["eager", "commfx"] + [f"commfx-budget-{b:g}" for b in budgets]


def _build(name: str, model_name: str, compute: str, device: str):
    """(a function running one step without zeroing gradients, the optimizer)."""
    import commfx
    from commfx.models import load_model
    from commfx.models.gpt_moe import grouped_experts
    from commfx.plan import Plan
    from commfx.train import loss_fn

    model, inputs = load_model(model_name, seed=0)
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    if name == "eager":
        grouped_experts(model)  # eager's experts as one grouped matmul, not the capturable per-row weight gather
        run, params = model, list(model.parameters())
    else:
        budget = float(name.rsplit("-", 1)[1]) if "budget" in name else None
        plan = dataclasses.replace(Plan.from_cli(PASSES, world_size=1), compute=compute, activation_memory_budget=budget)
        run = commfx.distribute(model, plan, inputs)
        params = list(run.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if hasattr(run, "attach_optimizer"):
        run.attach_optimizer(optimizer)

    def step():
        out = run(*inputs)
        loss_fn(out, inputs).backward()
        optimizer.step()

    return step, optimizer


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rss_growth(step, optimizer) -> int | None:
    """Peak resident set over one step above the resident set before it (None where the
    high-water mark cannot be reset)."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    before = _status("VmRSS")
    step()
    return _status("VmHWM") - before


def _allocator_peak(prof) -> tuple[int, int]:
    """(live tensor bytes when the measured step began, the most during it) from the
    profiler's allocation events, each carrying the allocator's running total."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    mark = next(e for e in events if e.tag == _EventType.TorchOp and e.name == MARK)
    start, end = mark.start_time_ns, mark.end_time_ns
    inside = sorted((e for e in events if e.tag == _EventType.Allocation and start <= e.start_time_ns <= end), key=lambda e: e.start_time_ns)
    if not inside:
        raise RuntimeError("no allocation inside the measured step: is profile_memory on?")
    first = inside[0].extra_fields
    return first.total_allocated - first.alloc_size, max(e.extra_fields.total_allocated for e in inside)


def measure_variant(name: str, model_name: str, compute: str, device: str, steps: int) -> dict:
    """One variant, in this process."""
    from torch.profiler import ProfilerActivity, profile, record_function

    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if device == "cuda":
            step, optimizer = _build(name, model_name, compute, device)
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            return {"peak_bytes": torch.cuda.max_memory_allocated(), "live_before_step_bytes": before, "rss_growth_bytes": None}
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step, optimizer = _build(name, model_name, compute, device)
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                step()
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            with record_function(MARK):
                step()
        before, peak = _allocator_peak(prof)
        return {"peak_bytes": peak, "live_before_step_bytes": before, "rss_growth_bytes": _rss_growth(step, optimizer)}
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-moe", help="a built-in model (default gpt-moe)")
    parser.add_argument("--budgets", default="0.1", help="commfx's activation memory budgets to measure beside no budget (comma-separated)")
    parser.add_argument("--compute", choices=("inductor", "interpret"), default=None, help="commfx's compute (default inductor; interpret under --quick)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="warm-up steps before the measured one (default 2; 1 under --quick)")
    parser.add_argument("--quick", action="store_true", help="interpreted graphs and one warm-up step: a check that the script works, not a measurement")
    parser.add_argument("--json", default=str(Path(__file__).parent / "memory_world1.json"))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # run one variant in this process, print its JSON
    args = parser.parse_args(argv)
    compute = args.compute or ("interpret" if args.quick else "inductor")
    steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    if args.variant:
        print(json.dumps(measure_variant(args.variant, args.model, compute, args.device, steps)))
        return 0
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    results = {}
    for name in variants(budgets):
        command = [sys.executable, __file__, "--variant", name, "--model", args.model, "--compute", compute, "--device", args.device, "--steps", str(steps)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{name} failed (exit {done.returncode})")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        rss = f", resident set +{r['rss_growth_bytes'] / 1e6:.2f} MB" if r["rss_growth_bytes"] is not None else ""
        print(f"{name:<22} peak {r['peak_bytes'] / 1e6:8.2f} MB (live before the step {r['live_before_step_bytes'] / 1e6:.2f} MB{rss})", flush=True)
    eager = results["eager"]["peak_bytes"]
    ratios = {name: r["peak_bytes"] / eager for name, r in results.items()}
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.3f}x eager's peak")
    method = ("torch.cuda.max_memory_allocated over the step" if args.device == "cuda" else
              "CPU allocator's running total of live tensor bytes from the torch profiler's allocation events (training thread), "
              "profiled from before the model is built; rss_growth_bytes: peak resident set over a further unprofiled step above the one before it")
    record = {"model": args.model, "passes": PASSES, "compute": compute, "device": args.device, "warmup_steps": steps, "quick": args.quick,
              "torch": torch.__version__, "method": method, "results": results, "peak_ratio_to_eager": ratios}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
