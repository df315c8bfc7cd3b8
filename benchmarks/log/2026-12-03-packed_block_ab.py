"""A/B: the packed exchange's glue ops opened (new) vs opaque (old), one process, no comm:
the rows a rank sends come back as the rows it receives (world-2 layout, rank 0)."""
import statistics, time, sys
import torch, torch.fx as fx
import commfx.ops  # noqa
import commfx.compiler.lower as lower
from commfx.ops import decompositions as d
commfx = torch.ops.commfx
N, H, INNER, L, K, RANKS = 1024, 128, 448, 4, 2, 2

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up = torch.nn.Parameter(torch.randn(L, 2 * INNER, H, generator=g) / H**0.5)
        self.down = torch.nn.Parameter(torch.randn(L, H, INNER, generator=g) / INNER**0.5)
    def forward(self, x, slots, weights):
        rows, meta, row_token, send = commfx.rank_dispatch(x, slots, weights, RANKS, L)
        payload = commfx.attach_meta(rows, meta)
        r, w, ids = commfx.detach_meta(payload, meta)
        ids = torch.where(ids >= 0, ids, -1)
        y = commfx.packed_expert_ffn(r, ids, w, self.gate_up, self.down, "silu")
        return (commfx.scatter_add_tokens(y, row_token, x),)

g = torch.Generator().manual_seed(1)
slots = torch.rand(N, L * RANKS, generator=g).topk(K, dim=1).indices
weights = torch.rand(N, K, generator=g)
x = torch.randn(N, H)
old = {k: v for k, v in d.compute_decompositions().items()
       if k not in (commfx.attach_meta.default, commfx.detach_meta.default, commfx.scatter_add_tokens.default, commfx.rank_dispatch_backward.default)}
new = d.compute_decompositions()
import exact
ex = dict(new); ex[commfx.packed_expert_ffn.default] = exact.packed_ffn; ex[commfx.packed_expert_ffn_backward.default] = exact.packed_ffn_backward
runs = {}
for name, table in (("opaque glue", old), ("opened glue", new), ("exact", ex)):
    lower.compute_decompositions = lambda t=table: t
    m = Block(); gm = fx.symbolic_trace(m)
    xs = x.clone().requires_grad_(); ws = weights.clone().requires_grad_()
    runs[name] = (lower.compile_training(gm, (xs, slots, ws), forward=lambda g: g, backward=lambda g: g, compute="inductor"), xs, ws, list(gm.parameters()))
times = {n: [] for n in runs}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    for n, (fn, xs, ws, ps) in runs.items():
        for t in (xs, ws, *ps): t.grad = None
        s = time.perf_counter(); out = fn(xs, slots, ws)[0]; out.sum().backward(); times[n].append(time.perf_counter() - s)
import copy

for n, ts in times.items():
    print(f"{n}: median {statistics.median(ts[5:]) * 1e3:.2f} ms fwd+bwd (p25 {statistics.quantiles(ts[5:], n=4)[0]*1e3:.2f}, p75 {statistics.quantiles(ts[5:], n=4)[2]*1e3:.2f})")
