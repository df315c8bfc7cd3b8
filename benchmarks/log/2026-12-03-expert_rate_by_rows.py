"""The experts' two grouped GEMMs (forward) on one CPU core against the rows each expert gets
(2026-12-03 notebook entry): the toy gpt-moe's experts (8, hidden 128, width 1024, fp32).
A chunk of a partitioned region gives each expert 1/k of its rows and rereads every weight,
so the FLOP rate the cost model takes for the whole region falls with k.
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/log/2026-12-03-expert_rate_by_rows.py"""
import time

import torch

from commfx.kernels import grouped_mm

torch.set_num_threads(1)
EXPERTS, HIDDEN, WIDTH = 8, 128, 1024
for per_expert in (128, 64, 32, 16):
    rows = per_expert * EXPERTS
    x, up, down = torch.randn(rows, HIDDEN), torch.randn(EXPERTS, WIDTH, HIDDEN), torch.randn(EXPERTS, HIDDEN, WIDTH)
    counts = torch.full((EXPERTS,), per_expert, dtype=torch.int64)
    best = float("inf")
    for _ in range(23):  # the first three warm up
        start = time.perf_counter()
        grouped_mm(grouped_mm(x, up, counts), down, counts)
        best = min(best, time.perf_counter() - start)
    print(f"{per_expert:4d} rows per expert: {2 * 2 * rows * HIDDEN * WIDTH / best / 1e9:6.1f} GFLOP/s")
