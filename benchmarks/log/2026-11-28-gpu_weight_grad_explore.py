"""Weight gradient of the experts' grouped GEMM on the GPU: which formulation reaches the bf16
floor at Mixtral-8x7B widths. Shapes as benchmarks/gpu_kernels.py (8 experts, hidden 4096,
inner 3584 and 7168, 16384 uneven rows). Prints one JSON line per variant."""
import json, sys, time, traceback
import torch, triton, triton.testing
sys.path.insert(0, "benchmarks")
from gpu_kernels import ceilings, uneven_counts
from commfx import kernels as K
G = sys.modules['commfx.kernels.grouped_mm']

torch.backends.cuda.matmul.allow_tf32 = False
bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
ceil = ceilings()
print(json.dumps({"ceilings": ceil}), flush=True)
E, HID, T = 8, 4096, 16384
for INNER in (3584, 7168):
    counts = uneven_counts(T, E)
    c = counts.cuda()
    x = torch.randn(T, HID, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(T, INNER, device="cuda", dtype=torch.bfloat16)
    floor = 2 * T * HID * INNER / ceil["bf16_TFLOPs"] / 1e9
    ref = K.grouped_mm_weight_grad_reference(g.float(), x.float(), counts.cuda())
    offs = torch.cumsum(c, 0, dtype=torch.int32)
    sizes = counts.tolist()

    def loop():
        out = x.new_empty(E, INNER, HID); s = 0
        for e, n in enumerate(sizes):
            torch.mm(g[s:s + n].t(), x[s:s + n], out=out[e]); s += n
        return out

    variants = {
        "old (cublas A=g.t())": lambda: torch._grouped_mm(g.t(), x, offs=offs),
        "commfx now": lambda: K.grouped_mm_weight_grad(g, x, c),
        "cublas swapped x.t() @ g, transposed view": lambda: torch._grouped_mm(x.t(), g, offs=offs).transpose(1, 2),
        "per-expert torch.mm (host counts)": loop,
    }
    for bm, bn, bk, w, st in [(64, 128, 64, 4, 3), (64, 128, 128, 8, 3), (64, 128, 128, 4, 4), (32, 128, 128, 4, 4),
                              (64, 256, 128, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 8, 4), (128, 256, 64, 8, 3),
                              (64, 128, 256, 8, 3), (128, 128, 64, 4, 4)]:
        variants[f"triton bm{bm} bn{bn} bk{bk} w{w} s{st}"] = (
            lambda bm=bm, bn=bn, bk=bk, w=w, st=st: G._grouped_mm_weight_grad_triton(g, x, c, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st))
    for name, fn in variants.items():
        try:
            out = fn().float()
            err = ((out - ref).norm() / ref.norm()).item()
            ms = bench(fn)
            print(json.dumps({"inner": INNER, "variant": name, "ms": ms, "floor_ms": floor, "share": floor / ms, "rel_err": err}), flush=True)
        except Exception as e:
            print(json.dumps({"inner": INNER, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
    # Inductor's grouped-mm template, max-autotune (the lead), time-bounded by the caller
    if INNER != 3584:
        continue
    try:
        t0 = time.perf_counter()
        f = torch.compile(lambda a, b, o: torch._grouped_mm(a, b, offs=o), mode="max-autotune-no-cudagraphs", dynamic=False)
        out = f(g.t(), x, offs).float()
        err = ((out - ref).norm() / ref.norm()).item()
        ms = bench(lambda: f(g.t(), x, offs))
        print(json.dumps({"inner": INNER, "variant": "inductor max-autotune _grouped_mm", "ms": ms, "floor_ms": floor, "share": floor / ms,
                          "rel_err": err, "compile_s": time.perf_counter() - t0}), flush=True)
    except Exception as e:
        traceback.print_exc()
        print(json.dumps({"inner": INNER, "variant": "inductor", "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
