"""The HF-models-through-every-door table: family x door -> largest difference, float64.

    .venv/bin/python benchmarks/hf_doors.py            # about 4 minutes on 2 cores

Doors: `commfx.distribute` (through `commfx.verify.verify`, 2 gloo ranks, outputs and every
gradient against the single-process model), the CLI (`commfx verify hf:<family>` in a
subprocess; its "largest difference" line), and `torch.compile(model,
backend=commfx.backend(plan))` with HF computing its loss from labels= (logits, loss and
every gradient against eager). Float32-router gradients are listed separately: they are
judged at float32 tolerance (see README, "verify and deliberate low precision").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "granitemoe"]
BACKEND_FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]
WORLD = 2


def backend_worker(rank: int, world_size: int, family: str) -> dict:
    import commfx
    from commfx.models import load_model
    from commfx.plan import Plan
    from commfx.verify import split_batch

    model, (ids,) = load_model(f"hf:{family}", dtype=torch.float64, batch=2 * world_size)
    local = split_batch(ids, world_size, rank)
    out = torch.compile(model, backend=commfx.backend(Plan.from_cli("lift,expert_parallel", world_size=world_size)))(
        input_ids=local, labels=local
    )
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def backend_diff(family: str) -> float:
    from commfx.models import load_model
    from commfx.models.hf import choose_experts_implementation
    from commfx.runtime.launcher import launch
    from commfx.verify import split_batch

    sys.path.insert(0, str(Path(__file__).parent))
    results = launch("hf_doors:backend_worker", WORLD, {"family": family}, timeout_s=300)
    model, (ids,) = load_model(f"hf:{family}", dtype=torch.float64, batch=2 * WORLD)
    choose_experts_implementation(model)
    refs = [model(input_ids=split_batch(ids, WORLD, r), labels=split_batch(ids, WORLD, r), use_cache=False) for r in range(WORLD)]
    (sum(r.loss for r in refs) / WORLD).backward()
    diff = 0.0
    for got, ref in zip(results, refs):
        diff = max(diff, (got["loss"] - ref.loss).abs().item(), (got["logits"] - ref.logits).abs().max().item())
        diff = max([diff] + [(got["grads"][n] - p.grad).abs().max().item() for n, p in model.named_parameters()])
    return diff


def cli_diff(family: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "commfx", "verify", f"hf:{family}", "--world-size", str(WORLD)],
        capture_output=True, text=True, timeout=600,
    ).stdout
    match = re.search(r"(PASS|FAIL): largest difference (\S+)", out)
    return f"{match.group(2)} ({match.group(1)})" if match else "no result"


def main() -> None:
    from commfx.plan import Plan
    from commfx.verify import VerifyCase, verify

    cases = [VerifyCase(f"hf:{f}", Plan.from_cli("lift,expert_parallel", world_size=WORLD), batch=3) for f in FAMILIES]
    reports = verify(cases, WORLD, timeout_s=900)
    print("| family | distribute (API) | CLI verify | backend (HF loss) | float32-router grads (judged at f32) |")
    print("|---|---|---|---|---|")
    for family, report in zip(FAMILIES, reports):
        exact = max([report.output_diff, report.replica_diff] + [d for n, d in report.grad_diffs.items() if n not in report.low_precision])
        low = max([report.grad_diffs[n] for n in report.low_precision], default=None)
        backend = f"{backend_diff(family):.2e}" if family in BACKEND_FAMILIES else "not run"
        print(f"| {family} | {exact:.2e} | {cli_diff(family)} | {backend} | {'—' if low is None else f'{low:.2e}'} |", flush=True)


if __name__ == "__main__":
    main()
