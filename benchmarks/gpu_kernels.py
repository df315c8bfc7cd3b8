"""commfx's Triton kernels on a GPU against what a user would run instead, and the roofline.

Each row times one kernel (median of `triton.testing.do_bench`, CUDA events, after warm-up)
on inputs with Mixtral-8x7B's expert proportions scaled to fit one launch well past its
overhead, and states the floor it is measured against:

- grouped GEMM (the experts' up projection): commfx's entry point (cuBLAS's grouped GEMM
  where bf16 operands fit), its Triton kernel alone, torch's `torch._grouped_mm`, and one
  matmul per expert (what a plain loop does); floor = FLOPs ÷ the measured dense bf16 rate;
- the weight gradient of the same GEMM, the same four ways, and with the cast to the float32
  master weights' layout a bf16 step adds;
- packed experts (gate-up, activation, down, weighted scatter-add; Lina's packing);
- row gather / scatter-add (the dispatch permutation), against `index_select` /
  `index_add_`; floor = bytes read + written ÷ the measured copy bandwidth;
- the fp8 dispatch codec (encode, decode), bytes floor likewise.

The two ceilings are measured first, on the same card, in the same run: a large
device-to-device copy and an 8192³ bf16 matmul. Run: `python benchmarks/gpu_kernels.py
[--json FILE]` (a CUDA GPU; prints a table, the card named).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

from commfx import kernels as K
from commfx.bench.run_record import RunRecorder
from commfx.ops import fp8_dispatch

packed_module = sys.modules["commfx.kernels.packed_experts"]  # the package's names are the functions
grouped_module = sys.modules["commfx.kernels.grouped_mm"]
EXPERTS, HIDDEN, INNER = 8, 4096, 3584  # Mixtral-8x7B's 8 experts and hidden width; a quarter of its 14336 inner width
TOKENS = 16384  # routed rows (top-2 of 8192 tokens)
PROPORTIONS = "mixtral-8x7b shapes, inner width / 4"


def bench(fn) -> float:
    """Median milliseconds of `fn` (CUDA events)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB copied: read + written = 2 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    copy_ms = bench(lambda: b.copy_(a))
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: x @ y)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def uneven_counts(total: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert as a top-2 router gives them: uneven, summing to `total`."""
    g = torch.Generator().manual_seed(seed)
    share = torch.rand(experts, generator=g) + 0.5  # between 1/3 and 3x of one another
    counts = (share / share.sum() * total).floor().long()
    counts[0] += total - counts.sum()
    return counts


def grouped_rows(ceiling: dict, dtype=torch.bfloat16) -> list[dict]:
    """The experts' up projection and its weight gradient: commfx's entry points (cuBLAS's
    grouped GEMM where bf16 operands fit, else Triton), its Triton kernels alone, what a
    user would call instead, and the weight gradient's cost delivered as the bf16 step
    consumes it (cast to float32 master weights' contiguous layout)."""
    counts = uneven_counts(TOKENS, EXPERTS)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=dtype)
    w = torch.randn(EXPERTS, INNER, HIDDEN, device="cuda", dtype=dtype) * HIDDEN**-0.5
    c = counts.cuda()
    floor_ms = 2 * TOKENS * HIDDEN * INNER / ceiling["bf16_TFLOPs"] / 1e9
    sizes = counts.tolist()

    def loop():
        out, start = x.new_empty(TOKENS, INNER), 0
        for e, n in enumerate(sizes):
            out[start : start + n] = x[start : start + n] @ w[e].T
            start += n
        return out

    reference = loop().float()
    error = lambda out: ((out.float() - reference).norm() / reference.norm()).item()  # noqa: E731
    offsets = torch.cumsum(c, 0).to(torch.int32)
    forward = {
        "grouped GEMM (up proj) · commfx grouped_mm": lambda: K.grouped_mm(x, w, c),
        "grouped GEMM · commfx Triton kernel": lambda: grouped_module._grouped_mm_triton(x, w, c),
        "grouped GEMM · torch._grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
        "grouped GEMM · one matmul per expert": loop,
    }
    rows = [{"kernel": name, "ms": bench(fn), "floor_ms": floor_ms, "rel_error": error(fn())} for name, fn in forward.items()]

    grad = torch.randn(TOKENS, INNER, device="cuda", dtype=dtype)

    def grad_loop():
        out, start = x.new_empty(EXPERTS, INNER, HIDDEN), 0
        for e, n in enumerate(sizes):
            torch.mm(grad[start : start + n].t(), x[start : start + n], out=out[e])
            start += n
        return out

    grad_reference = grad_loop().float()
    grad_error = lambda out: ((out.float() - grad_reference).norm() / grad_reference.norm()).item()  # noqa: E731
    weight_grad = {
        "weight grad · commfx grouped_mm_weight_grad": lambda: K.grouped_mm_weight_grad(grad, x, c),
        "weight grad · commfx Triton kernel": lambda: grouped_module._grouped_mm_weight_grad_triton(grad, x, c),
        "weight grad · torch._grouped_mm, row-major [E, N, K] out": lambda: torch._grouped_mm(grad.t(), x, offs=offsets),
        "weight grad · one matmul per expert": grad_loop,
        "weight grad + float32 contiguous cast · commfx": lambda: K.grouped_mm_weight_grad(grad, x, c).to(
            torch.float32, memory_format=torch.contiguous_format),
        "weight grad + float32 cast · row-major [E, N, K] out": lambda: torch._grouped_mm(grad.t(), x, offs=offsets).float(),
    }
    rows += [{"kernel": name, "ms": bench(fn), "floor_ms": floor_ms, "rel_error": grad_error(fn())} for name, fn in weight_grad.items()]
    return rows


def packed_row(ceiling: dict, dtype=torch.bfloat16) -> dict:
    tokens, top_k = TOKENS // 2, 2
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
    counts = uneven_counts(tokens * top_k, EXPERTS, seed=1)
    row = torch.cat([torch.randperm(tokens, device="cuda")[:n] for n in counts.tolist()])
    weight = torch.rand(row.numel(), device="cuda", dtype=dtype)
    gate_up = torch.randn(EXPERTS, 2 * INNER, HIDDEN, device="cuda", dtype=dtype) * HIDDEN**-0.5
    down = torch.randn(EXPERTS, HIDDEN, INNER, device="cuda", dtype=dtype) * INNER**-0.5
    c = counts.cuda()
    flops = 2 * row.numel() * HIDDEN * 3 * INNER
    run = lambda: packed_module.packed_experts(x, row, weight, c, gate_up, down, "silu")  # noqa: E731
    ref = packed_module.packed_experts_reference(x.float(), row, weight.float(), c, gate_up.float(), down.float(), "silu")
    out = run().float()
    return {"kernel": "packed experts (gate-up, SiLU, down, scatter) · commfx Triton", "ms": bench(run),
            "floor_ms": flops / ceiling["bf16_TFLOPs"] / 1e9, "rel_error": ((out - ref).norm() / ref.norm()).item()}


def permute_rows(ceiling: dict, dtype=torch.bfloat16) -> list[dict]:
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=dtype)
    index = torch.randint(0, TOKENS, (TOKENS,), device="cuda")
    moved = 2 * TOKENS * HIDDEN * x.element_size()  # each row read once and written once
    floor_ms = moved / ceiling["copy_GBps"] / 1e6
    assert torch.equal(K.gather_rows(x, index), x.index_select(0, index))
    rows = [
        {"kernel": "gather rows (dispatch permute) · commfx Triton", "ms": bench(lambda: K.gather_rows(x, index)), "floor_ms": floor_ms},
        {"kernel": "gather rows · torch index_select", "ms": bench(lambda: x.index_select(0, index)), "floor_ms": floor_ms},
    ]
    target = torch.zeros(TOKENS, HIDDEN, device="cuda", dtype=dtype)
    scatter_floor = (3 * TOKENS * HIDDEN * x.element_size()) / ceiling["copy_GBps"] / 1e6  # read src and out, write out
    rows.append({"kernel": "scatter-add rows (combine) · commfx Triton", "ms": bench(lambda: K.scatter_add_rows(x, index, TOKENS)), "floor_ms": scatter_floor})
    rows.append({"kernel": "scatter-add rows · torch index_add_", "ms": bench(lambda: target.zero_().index_add_(0, index, x)), "floor_ms": scatter_floor})
    return rows


def fp8_rows(ceiling: dict) -> list[dict]:
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    payload = fp8_dispatch.encode(x)
    encode_bytes = x.numel() * 2 + payload.numel()
    return [
        {"kernel": "fp8 dispatch encode (torch ops)", "ms": bench(lambda: fp8_dispatch.encode(x)), "floor_ms": encode_bytes / ceiling["copy_GBps"] / 1e6},
        {"kernel": "fp8 dispatch decode (torch ops)", "ms": bench(lambda: fp8_dispatch.decode(payload, HIDDEN, 0, torch.bfloat16)),
         "floor_ms": encode_bytes / ceiling["copy_GBps"] / 1e6},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows and the ceilings here")
    args = parser.parse_args()
    recorder = RunRecorder(proportions=PROPORTIONS)
    torch.backends.cuda.matmul.allow_tf32 = False
    card = torch.cuda.get_device_name()
    ceiling = ceilings()
    rows = [*grouped_rows(ceiling), packed_row(ceiling), *permute_rows(ceiling), *fp8_rows(ceiling)]
    print(f"{card}; torch {torch.__version__}, triton {triton.__version__}; measured copy {ceiling['copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {ceiling['bf16_TFLOPs']:.0f} TFLOP/s; experts {EXPERTS}, hidden {HIDDEN}, inner {INNER}, routed rows {TOKENS}")
    print(f"{'kernel':<66} {'ms':>8} {'floor ms':>9} {'floor/ms':>9} {'rel err':>9}")
    for r in rows:
        err = f"{r['rel_error']:.1e}" if "rel_error" in r else ""
        print(f"{r['kernel']:<66} {r['ms']:>8.3f} {r['floor_ms']:>9.3f} {r['floor_ms'] / r['ms']:>9.2f} {err:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "triton": triton.__version__, "ceilings": ceiling, "rows": rows,
                       "run": recorder.finish()}, f, indent=2)


if __name__ == "__main__":
    main()
