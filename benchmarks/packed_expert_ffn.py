"""packed_expert_ffn's forward and backward, opaque against opened (ops/decompositions.py).

    .venv/bin/python benchmarks/packed_expert_ffn.py                 # CPU, float32
    python3 benchmarks/packed_expert_ffn.py --device cuda --dtype bfloat16

One process. Mixtral's proportions at hidden 256 (expert hidden 896), 4 local experts, top-2,
2048 received rows, two routings: every assignment local (world 1) and one rank of two
(8 experts, 4 here: a received row has a second assignment elsewhere about 4 times in 7).
Variants, each on its own copy of the weights: `eager` (the op under autograd), `interpret`
(commfx's compile path, the op opaque in the aot graph) and `inductor` (commfx's compile path
with compute="inductor": the op opened around its grouped GEMMs, regions compiled). Rounds
interleave the variants; the first `--warmup` are dropped, the median of the rest is shown.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.fx as fx

import commfx.ops  # noqa: F401
from commfx.compiler.lower import compile_training


class Packed(torch.nn.Module):
    def __init__(self, experts: int, hidden: int, inner: int, dtype: torch.dtype, device: str):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up = torch.nn.Parameter((torch.randn(experts, 2 * inner, hidden, generator=g) / hidden**0.5).to(device, dtype))
        self.down = torch.nn.Parameter((torch.randn(experts, hidden, inner, generator=g) / inner**0.5).to(device, dtype))

    def forward(self, x, local_ids, weights):
        return (torch.ops.commfx.packed_expert_ffn(x, local_ids, weights, self.gate_up, self.down, "silu"),)


def routing(rows: int, k: int, local: int, ranks: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids [rows, k] (-1: the expert lives on another rank) of rows that each chose k
    distinct experts of local * ranks and have at least one here (rank 0), and their weights."""
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(rows * 4, local * ranks, generator=g)
    scores[:, 0] += 2  # at least one expert here for the rows kept below
    chosen = scores.topk(k, dim=1).indices[:rows]
    ids = torch.where(chosen < local, chosen, -1)
    weights = torch.rand(rows, k, generator=g) * (ids >= 0)
    return ids.to(device), weights.to(device)


def _step(fn, x, ids, weights, grad, params):
    for t in (x, weights, *params):
        t.grad = None
    out = fn(x, ids, weights)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.backward(grad)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for label, ranks in (("world 1 (all local)", 1), ("rank 0 of 2", 2)):
        ids, weights = routing(args.rows, 2, 4, ranks, args.device)
        x = torch.randn(args.rows, 256, device=args.device, dtype=dtype, requires_grad=True)
        weights.requires_grad_()
        grad = torch.randn_like(x)
        variants = {}
        for name in ("eager", "interpret", "inductor"):
            module = Packed(4, 256, 896, dtype, args.device)
            if name == "eager":
                variants[name] = (module, list(module.parameters()))
                continue
            gm = fx.symbolic_trace(module)
            run = compile_training(gm, (x, ids, weights), forward=lambda g: g, backward=lambda g: g, compute=name)
            variants[name] = (run, list(gm.parameters()))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (fn, params) in variants.items():
                sync()
                start = time.perf_counter()
                _step(fn, x, ids, weights, grad, params)
                sync()
                times[name].append(time.perf_counter() - start)
        invalid = (ids < 0).float().mean().item()
        medians = {name: statistics.median(t[args.warmup:]) * 1e3 for name, t in times.items()}
        print(f"{label}: {args.rows} rows, {invalid:.0%} of assignments elsewhere, {args.device} {args.dtype}, "
              f"median of {args.rounds - args.warmup} rounds, forward+backward ms: "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in medians.items())
              + f"; inductor / interpret {medians['inductor'] / medians['interpret']:.2f}")


if __name__ == "__main__":
    main()
