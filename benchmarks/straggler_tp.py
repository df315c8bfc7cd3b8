"""Tensor parallelism with a straggler (issue 14): step time and training quality.

    .venv/bin/python benchmarks/straggler_tp.py --json benchmarks/straggler_tp.json

1. **Step time**, one interleaved `commfx bench` run, tp=2 on the emulated cluster of
   2 nodes x 1 rank: plain tp with no straggler (`--healthy`), then with rank 1 at half
   speed (`--slow-rank 1:2`) and nothing done, ZERO-resizing only, migration only, and
   SEMI-migration (the controller chooses).
2. **Quality**: 300 steps on pydoc_data.topics bytes (fixed seeds, consecutive batches
   never repeated), the same model from the same start: plain tp without a straggler,
   SEMI-migration with rank 1 at half speed, and resizing only with rank 1 at half speed
   (the lossy remedy on its own). Final loss: the mean of the last 20 steps.

The model is `dense_gpt` below (a dense GPT: attention and a GELU MLP per layer, so tensor
parallelism covers most of the compute; MoE experts would stay replicated and un-resizable).
The straggler is emulated by per-op delays (`--slow-method delay`): on a machine shared with
other work a CPU quota caps a rank without making it a known factor slower than the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pydoc_data.topics
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from commfx.bench.run_record import RunRecorder

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
VOCAB, LAYERS, SEQ = 256, 2, 64


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    mlp: int


SIZES = {  # model file entry point -> its size
    # hidden 256: the tp linears are ~40% of a rank's step on this CPU; norms, attention
    # scores, the LM head, the loss and the interpreter make up the rest
    "dense_gpt": Size(256, 4, 1024),
    # hidden 768 (GPT-2 small's width): the tp linears dominate a step, as in the large
    # models tensor parallelism is for
    "dense_gpt_wide": Size(768, 12, 3072),
}
TP = "lift,tensor_parallel"
BENCH_PLANS = {  # label -> passes; "no straggler" is measured healthy, the others with rank 1 slow
    "no straggler": TP,
    "straggler, nothing done": TP,
    "resizing": TP + ",resize_tp:mode=resize",
    "migration": TP + ",resize_tp:mode=migrate",
    "SEMI-migration": TP + ",resize_tp",
}
QUALITY_PLANS = {  # label -> (passes, slowed)
    "no straggler": (TP, False),
    "SEMI-migration, rank 1 at half speed": (TP + ",resize_tp", True),
    "resizing only, rank 1 at half speed": (TP + ",resize_tp:mode=resize", True),
}


class Attention(nn.Module):
    def __init__(self, size: Size):
        super().__init__()
        self.heads = size.heads
        self.qkv = nn.Linear(size.hidden, 3 * size.hidden, bias=False)
        self.proj = nn.Linear(size.hidden, size.hidden, bias=False)

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Mlp(nn.Module):
    def __init__(self, size: Size):
        super().__init__()
        self.up = nn.Linear(size.hidden, size.mlp)
        self.down = nn.Linear(size.mlp, size.hidden)

    def forward(self, h):
        return self.down(F.gelu(self.up(h)))


class Layer(nn.Module):
    def __init__(self, size: Size):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(size.hidden), Attention(size)
        self.ln2, self.mlp = nn.LayerNorm(size.hidden), Mlp(size)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class DenseGPT(nn.Module):
    """byte ids [B, S] -> logits [B, S, 256]."""

    def __init__(self, size: Size):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, size.hidden), nn.Embedding(SEQ, size.hidden)
        self.layers = nn.ModuleList(Layer(size) for _ in range(LAYERS))
        self.ln_f, self.lm_head = nn.LayerNorm(size.hidden), nn.Linear(size.hidden, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.ln_f(h))


def dense_gpt(batch: int = 8, size: Size = SIZES["dense_gpt"]):
    """The model and a batch of bytes of the corpus (the bench's model file entry point)."""
    torch.manual_seed(0)
    return DenseGPT(size), (corpus_batches(batch, SEQ, 1)[0],)


def dense_gpt_wide(batch: int = 8):
    """`dense_gpt` at hidden 768 (a model file entry point)."""
    return dense_gpt(batch, SIZES["dense_gpt_wide"])


def corpus_batches(batch: int, seq: int, steps: int) -> torch.Tensor:
    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8", "replace")
    data = torch.tensor(list(text), dtype=torch.long)
    need = steps * batch * seq
    if need > data.numel():
        raise SystemExit(f"{steps} steps of {batch}x{seq} bytes need {need} bytes; the corpus has {data.numel()}")
    return data[:need].view(steps, batch, seq)


# ----------------------------------------------------------------------------- step time


def bench_command(args, out: Path) -> list[str]:
    commfx = shutil.which("commfx", path=str(Path(sys.executable).parent)) or "commfx"
    (under_test, under_test_passes), *others = [(k, v) for k, v in BENCH_PLANS.items() if k != "no straggler"]
    command = [commfx, "bench", f"{HERE.relative_to(ROOT)}:{args.model}", "--tp", "2", "--nodes", "2", "--ranks-per-node", "1",
               "--inter-node", args.link, "--passes", under_test_passes, "--vs", BENCH_PLANS["no straggler"],
               "--healthy", "baseline", "--slow-rank", "1:2", "--slow-method", "delay",
               "--steps", str(args.bench_steps), "--warmup", str(args.bench_warmup), "--json", str(out)]
    for label, passes in others:
        command += ["--also", f"{label}={passes}"]
    return command


def step_times(args) -> dict:
    out = Path(args.workdir) / "straggler_bench.json"
    command = bench_command(args, out)
    print("$", " ".join(f"'{c}'" if " " in c or "," in c else c for c in command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, timeout=3600)
    result = json.loads(out.read_text())
    names = {"plan": "straggler, nothing done", "baseline": "no straggler"}
    base = next(p for p in result["plans"] if p["label"] == "baseline")["wall"]["median_s"]
    rows = []
    for p in result["plans"]:
        rows.append({
            "plan": names.get(p["label"], p["label"]), "passes": p["passes"], "slowed": p["straggler_slowed"],
            "step_ms": 1e3 * p["wall"]["median_s"], "p25_ms": 1e3 * p["wall"]["p25_s"], "p75_ms": 1e3 * p["wall"]["p75_s"],
            "vs_no_straggler": p["wall"]["median_s"] / base,
            "compute_only_ms": 1e3 * p["compute_only"]["median_s"], "comm_only_ms": 1e3 * p["comm_only"]["median_s"],
            "rank_compute_ms": [1e3 * t for t in p["rank_step_compute_median_s"]],
            "decisions": p["resize_tp_decisions"],
        })
    order = list(BENCH_PLANS)
    rows.sort(key=lambda r: order.index(r["plan"]))
    return {"command": command, "rows": rows, "bench": result}


# ----------------------------------------------------------------------------- quality


def quality_worker(rank: int, world_size: int, steps: int, batch: int, model: str = "dense_gpt") -> dict:
    from commfx.api import distribute
    from commfx.bench.straggler import RankSlowdown, prepare
    from commfx.plan import Plan

    data = corpus_batches(batch, SEQ, steps)
    slowdown = RankSlowdown(prepare(1, 2.0, world_size, "delay"), rank)
    out = {}
    model_name = model
    for label, (passes, slowed) in QUALITY_PLANS.items():
        model, _ = dense_gpt(batch, SIZES[model_name])
        dm = distribute(model, Plan.from_cli(passes, world_size=world_size, tp=world_size), (data[0],))
        optimizer = torch.optim.AdamW(dm.parameters(), lr=3e-3)
        dm.attach_optimizer(optimizer)  # resize_tp: migrated units move their optimizer state with them
        losses, start = [], time.perf_counter()
        with slowdown.applied(dm.scheduler, active=slowed):
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                logits = dm(data[step])
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), data[step][:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        controller = getattr(dm, "straggler", None)
        decisions = [d.line() for d in controller.decisions if d.action != "keep"] if controller else []
        errors = controller.errors if controller else []
        out[label] = {"losses": losses, "seconds": time.perf_counter() - start, "decisions": decisions,
                      "mean_resize_error": sum(errors) / len(errors) if errors else 0.0}
    return out


def quality(args) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from commfx.runtime.launcher import launch

    results = launch("straggler_tp:quality_worker", 2, {"steps": args.steps, "batch": args.batch, "model": args.model}, timeout_s=6 * 3600)
    curves, straggler = results[0], results[1]  # the loss is the same on both tp ranks; rank 1 is the one resized
    tail = min(20, args.steps)
    base = sum(curves["no straggler"]["losses"][-tail:]) / tail
    rows = []
    for label in QUALITY_PLANS:
        final = sum(curves[label]["losses"][-tail:]) / tail
        rows.append({"plan": label, "final_loss": final, "vs_no_straggler": final / base - 1,
                     "first_loss": curves[label]["losses"][0], "seconds": curves[label]["seconds"],
                     "mean_resize_error": straggler[label]["mean_resize_error"], "decisions": curves[label]["decisions"]})
    return {"rows": rows, "curves": {k: v["losses"] for k, v in curves.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="quality: training steps")
    parser.add_argument("--batch", type=int, default=8, help="quality: sequences of 64 bytes per step")
    parser.add_argument("--bench-steps", type=int, default=16)
    parser.add_argument("--bench-warmup", type=int, default=12, help="rounds before measuring (the controller decides every 4 steps)")
    parser.add_argument("--link", default="none", help="the emulated inter-node link (default none: unshaped veth; "
                        "tp runs over a node's fast links in practice)")
    parser.add_argument("--model", choices=sorted(SIZES), default="dense_gpt", help="the model's size (see SIZES)")
    parser.add_argument("--skip", choices=("bench", "quality"), default=None)
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    recorder = RunRecorder()
    out = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_before": Path("/proc/loadavg").read_text().split()[:3]}
    if args.skip != "bench":
        out["step_time"] = step_times(args)
        print("| plan | rank 1 | step ms (median, p25-p75) | vs no straggler | compute-only ms | comm-only ms | rank compute ms (0 / 1) |")
        print("|---|---|---|---|---|---|---|")
        for r in out["step_time"]["rows"]:
            print(f"| {r['plan']} | {'half speed' if r['slowed'] else 'full speed'} | {r['step_ms']:.1f} ({r['p25_ms']:.1f}-{r['p75_ms']:.1f}) | "
                  f"{r['vs_no_straggler']:.2f}x | {r['compute_only_ms']:.1f} | {r['comm_only_ms']:.1f} | "
                  f"{' / '.join(f'{t:.1f}' for t in r['rank_compute_ms'])} |")
    if args.skip != "quality":
        out["quality"] = quality(args)
        print(f"| plan ({args.steps} steps) | loss, mean of last 20 | vs no straggler | mean resizing error (rank 1) | seconds |")
        print("|---|---|---|---|---|")
        for r in out["quality"]["rows"]:
            print(f"| {r['plan']} | {r['final_loss']:.4f} | {100 * r['vs_no_straggler']:+.2f}% | {r['mean_resize_error']:.3f} | {r['seconds']:.0f} |")
    out["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    out["run"] = recorder.finish()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
