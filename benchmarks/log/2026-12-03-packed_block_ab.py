"""A/B of the packed MoE block compiled (2026-12-03 notebook entry): the exchange's glue ops
opaque or opened, the packed experts' layout padded (all V*k assignments) or cut (the valid
ones). One process, no communication: the rows rank 0 of 2 sends come back as the rows it
receives. Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/log/2026-12-03-packed_block_ab.py [ROUNDS]"""
import statistics
import sys
import time

import torch
import torch.fx as fx

import commfx.ops  # noqa: F401
import commfx.compiler.lower as lower
from commfx.ops import decompositions

commfx = torch.ops.commfx
N, H, INNER, L, K, RANKS = 1024, 128, 448, 4, 2, 2
GLUE = (commfx.attach_meta.default, commfx.detach_meta.default, commfx.scatter_add_tokens.default, commfx.rank_dispatch_backward.default)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up = torch.nn.Parameter(torch.randn(L, 2 * INNER, H, generator=g) / H**0.5)
        self.down = torch.nn.Parameter(torch.randn(L, H, INNER, generator=g) / INNER**0.5)

    def forward(self, x, slots, weights):
        rows, meta, row_token, _ = commfx.rank_dispatch(x, slots, weights, RANKS, L)
        received, w, ids = commfx.detach_meta(commfx.attach_meta(rows, meta), meta)
        y = commfx.packed_expert_ffn(received, ids, w, self.gate_up, self.down, "silu")
        return (commfx.scatter_add_tokens(y, row_token, x),)


def compiled(glue_opened: bool, cut: bool):
    table = {op: form for op, form in decompositions.compute_decompositions().items() if glue_opened or op not in GLUE}
    lower.compute_decompositions = lambda: table
    decompositions._cut_padding = lambda device: cut  # read while tracing, so set per variant
    gm = fx.symbolic_trace(Block())
    x, w = X.clone().requires_grad_(), WEIGHTS.clone().requires_grad_()
    return lower.compile_training(gm, (x, SLOTS, w), forward=lambda g: g, backward=lambda g: g, compute="inductor"), x, w, list(gm.parameters())


g = torch.Generator().manual_seed(1)
SLOTS = torch.rand(N, L * RANKS, generator=g).topk(K, dim=1).indices
WEIGHTS = torch.rand(N, K, generator=g)
X = torch.randn(N, H)
runs = {"glue opaque, padded": compiled(False, False), "glue opened, padded": compiled(True, False), "glue opened, padding cut": compiled(True, True)}
times = {name: [] for name in runs}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 80):
    for name, (fn, x, w, params) in runs.items():
        for t in (x, w, *params):
            t.grad = None
        start = time.perf_counter()
        fn(x, SLOTS, w)[0].sum().backward()
        times[name].append(time.perf_counter() - start)
for name, t in times.items():
    print(f"{name}: median {statistics.median(t[5:]) * 1e3:.2f} ms forward + backward")
