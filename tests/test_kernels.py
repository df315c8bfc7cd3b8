"""Tests of commfx.kernels: grouped GEMM and row permutations.

Three layers:
  * torch references (the CPU path) against plain loops / independent dense
    formulations in float64, plus hypothesis properties;
  * the real Triton kernels on CPU under TRITON_INTERPRET=1.  The variable must
    be set before triton is imported, so those checks run in one subprocess
    (this file run as a script) and each case is reported back as its own test;
  * GPU-only checks (compiled kernels on CUDA, bf16), marked ``gpu``.
Also an ahead-of-time compile of the kernels for sm_90 with Triton's bundled
ptxas: it needs no GPU and catches what the interpreter does not (typing,
layout lowering).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commfx.kernels as K

# The submodules are shadowed by same-named functions on the package.
gm_mod = sys.modules["commfx.kernels.grouped_mm"]
perm_mod = sys.modules["commfx.kernels.permute"]
packed_mod = sys.modules["commfx.kernels.packed_experts"]

SRC_DIR = Path(gm_mod.__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 240
HYP = settings(max_examples=20, deadline=None, database=None)

gpu = pytest.mark.gpu


def _dtype_id(d):
    return str(d).removeprefix("torch.")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def loop_grouped_mm(x, w, counts, trans_w):
    """The obvious per-expert loop, with explicit row ranges."""
    n = w.shape[1] if trans_w else w.shape[2]
    out = x.new_zeros((x.shape[0], n))
    start = 0
    for e, c in enumerate(counts.tolist()):
        w_e = w[e].T if trans_w else w[e]
        out[start:start + c] = x[start:start + c] @ w_e
        start += c
    return out


def dense_grouped_mm(x, w, counts, trans_w):
    """Independent formulation: one-hot expert assignment and an einsum."""
    e = counts.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(e), counts)
    onehot = torch.nn.functional.one_hot(expert_of_row, e).to(x.dtype)
    eq = "te,enk,tk->tn" if trans_w else "te,ekn,tk->tn"
    return torch.einsum(eq, onehot, w, x)


def make_inputs(counts, k, n, trans_w, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, dtype=torch.int64)
    t, e = int(counts.sum()), counts.numel()
    x = torch.randn(t, k, generator=g, dtype=torch.float64).to(dtype)
    wshape = (e, n, k) if trans_w else (e, k, n)
    w = torch.randn(wshape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, counts


COUNT_CASES = [
    [3],
    [2, 5, 1],
    [0, 4, 0, 3, 0],
    [0, 0, 0],  # T = 0 with experts
    [7, 0],
]


# --------------------------------------------------------------------------
# references: grouped_mm
# --------------------------------------------------------------------------

@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("counts", COUNT_CASES, ids=str)
def test_grouped_mm_reference_matches_loop_float64(counts, trans_w):
    x, w, c = make_inputs(counts, k=6, n=5, trans_w=trans_w)
    out = K.grouped_mm_reference(x, w, c, trans_w=trans_w)
    assert out.shape == (x.shape[0], 5) and out.dtype == torch.float64
    # Same matmul per expert: bitwise equal, the basis of float64 exactness.
    torch.testing.assert_close(out, loop_grouped_mm(x, w, c, trans_w), rtol=0, atol=0)
    torch.testing.assert_close(out, dense_grouped_mm(x, w, c, trans_w))
    # on CPU the public entry point computes the reference's products, in place
    torch.testing.assert_close(K.grouped_mm(x, w, c, trans_w=trans_w), out, rtol=0, atol=0)


@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("counts", COUNT_CASES, ids=str)
def test_cpu_kernels_with_padding_rows(counts, trans_w):
    """padded=True: rows past sum(counts) come out zero and add nothing to the weight
    gradient; the rows before them are the reference's, bit for bit."""
    x, w, c = make_inputs(counts, k=6, n=5, trans_w=trans_w)
    padding = torch.full((3, x.shape[1]), float("nan"), dtype=x.dtype)  # must not leak into anything
    out = K.grouped_mm(torch.cat([x, padding]), w, c, trans_w=trans_w, padded=True)
    torch.testing.assert_close(out[: x.shape[0]], K.grouped_mm_reference(x, w, c, trans_w=trans_w), rtol=0, atol=0)
    assert torch.equal(out[x.shape[0]:], torch.zeros(3, out.shape[1], dtype=out.dtype))
    if trans_w:
        g = torch.randn(x.shape[0], 5, dtype=x.dtype)
        gw = K.grouped_mm_weight_grad(torch.cat([g, torch.full((3, 5), float("nan"), dtype=x.dtype)]), torch.cat([x, padding]), c, padded=True)
        torch.testing.assert_close(gw, K.grouped_mm_weight_grad_reference(g, x, c), rtol=0, atol=0)
    with pytest.raises(ValueError, match="or less"):
        K.grouped_mm(x[:0], w, c + 1, trans_w=trans_w, padded=True)  # more counted rows than rows


def test_grouped_mm_reference_no_experts():
    x = torch.zeros(0, 4, dtype=torch.float64)
    w = torch.zeros(0, 3, 4, dtype=torch.float64)
    out = K.grouped_mm(x, w, torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 3) and out.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=_dtype_id)
def test_grouped_mm_reference_low_precision(dtype):
    x, w, c = make_inputs([3, 0, 5], k=16, n=8, trans_w=True, dtype=dtype)
    out = K.grouped_mm_reference(x, w, c)
    assert out.dtype == dtype
    exact = loop_grouped_mm(x.double(), w.double(), c, True)
    torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=2e-2)


def test_grouped_mm_reference_rejects_bad_args():
    x, w, c = make_inputs([2, 3], k=4, n=3, trans_w=True)
    with pytest.raises(ValueError):
        K.grouped_mm(x, w, torch.tensor([2, 2]))  # sum != T
    with pytest.raises(ValueError):
        K.grouped_mm(x, w, torch.tensor([-1, 6]))
    with pytest.raises(ValueError):
        K.grouped_mm(x, w, c, trans_w=False)  # w is [E, N, K], K != N here
    with pytest.raises(TypeError):
        K.grouped_mm(x, w.float(), c)
    with pytest.raises(ValueError):
        K.grouped_mm(x, w[:0], c[:0])  # rows but no experts


@pytest.mark.parametrize("counts", COUNT_CASES, ids=str)
def test_weight_grad_reference_matches_loop_and_autograd(counts):
    x, w, c = make_inputs(counts, k=6, n=5, trans_w=True)
    grad_out = torch.randn(x.shape[0], 5, dtype=torch.float64)
    gw = K.grouped_mm_weight_grad_reference(grad_out, x, c)
    assert gw.shape == w.shape and gw.dtype == torch.float64

    start = 0
    for e, n_e in enumerate(c.tolist()):
        expect = grad_out[start:start + n_e].T @ x[start:start + n_e]
        torch.testing.assert_close(gw[e], expect, rtol=0, atol=0)
        if n_e == 0:
            assert torch.count_nonzero(gw[e]) == 0
        start += n_e

    # It is the gradient of grouped_mm w.r.t. w, and grad_x is grouped_mm with
    # trans_w=False (the identities documented in grouped_mm.py); the kernels are not
    # differentiable, their reference is.
    x_ = x.clone().requires_grad_()
    w_ = w.clone().requires_grad_()
    K.grouped_mm_reference(x_, w_, c).backward(grad_out)
    torch.testing.assert_close(K.grouped_mm_weight_grad(grad_out, x, c), w_.grad)
    torch.testing.assert_close(K.grouped_mm(grad_out, w, c, trans_w=False), x_.grad)


@HYP
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    k=st.integers(1, 5),
    n=st.integers(1, 5),
    trans_w=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_mm_reference_property(counts, k, n, trans_w, seed):
    x, w, c = make_inputs(counts, k=k, n=n, trans_w=trans_w, seed=seed)
    out = K.grouped_mm_reference(x, w, c, trans_w=trans_w)
    torch.testing.assert_close(out, loop_grouped_mm(x, w, c, trans_w), rtol=0, atol=0)
    torch.testing.assert_close(out, dense_grouped_mm(x, w, c, trans_w))
    # Linearity in x per expert: permuting rows within an expert permutes output rows.
    t = x.shape[0]
    if t:
        perm = torch.arange(t)
        start = 0
        for n_e in c.tolist():
            perm[start:start + n_e] = perm[start:start + n_e].flip(0)
            start += n_e
        torch.testing.assert_close(K.grouped_mm_reference(x[perm], w, c, trans_w=trans_w), out[perm])


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_packed_experts_reference_is_the_per_assignment_sum(activation):
    """float64: every token row gets the sum of its assignments' weighted expert outputs,
    computed here one assignment at a time."""
    x, row, weight, c, gate_up, down = packed_inputs([5, 0, 3, 4], rows=7, hidden=6, inner=3, dtype=torch.float64)
    out = K.packed_experts(x, row, weight.double(), c, gate_up, down, activation)  # CPU: the reference
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "relu": torch.relu}[activation]
    expected = torch.zeros_like(x)
    experts = torch.repeat_interleave(torch.arange(4), c)
    for a in range(row.numel()):
        e, v = int(experts[a]), int(row[a])
        gate, up = (gate_up[e] @ x[v]).chunk(2)
        expected[v] += weight[a].double() * (down[e] @ (act(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="unknown activation"):
        K.packed_experts(x, row, weight, c, gate_up, down, "tanh")


@HYP
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=4), k=st.integers(1, 5),
       n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_weight_grad_reference_property(counts, k, n, seed):
    x, _, c = make_inputs(counts, k=k, n=n, trans_w=True, seed=seed)
    g = torch.randn(x.shape[0], n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    gw = K.grouped_mm_weight_grad_reference(g, x, c)
    # <grad_w, w> == <grad_out, grouped_mm(x, w)> for any w (adjointness)
    w = torch.randn(c.numel(), n, k, dtype=torch.float64)
    lhs = (gw * w).sum()
    rhs = (g * K.grouped_mm_reference(x, w, c)).sum()
    torch.testing.assert_close(lhs, rhs)


# --------------------------------------------------------------------------
# references: gather / scatter
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int8], ids=_dtype_id)
def test_gather_reference(dtype):
    x = torch.arange(5 * 2 * 3).reshape(5, 2, 3).to(dtype)
    index = torch.tensor([4, 0, 0, 2])
    out = K.gather_rows(x, index)
    assert out.dtype == dtype and out.shape == (4, 2, 3)
    for i, j in enumerate(index.tolist()):
        assert torch.equal(out[i], x[j])
    assert K.gather_rows(x, torch.zeros(0, dtype=torch.int64)).shape == (0, 2, 3)
    with pytest.raises(IndexError):
        K.gather_rows(x, torch.tensor([5]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int8], ids=_dtype_id)
def test_scatter_add_reference(dtype):
    src = torch.arange(6 * 3).reshape(6, 3).to(dtype)
    index = torch.tensor([2, 0, 2, 2, 5, 0])
    out = K.scatter_add_rows(src, index, num_rows=7)
    assert out.dtype == dtype and out.shape == (7, 3)
    expect = torch.zeros(7, 3, dtype=torch.float64)
    for i, r in enumerate(index.tolist()):
        expect[r] += src[i].double()
    torch.testing.assert_close(out.double(), expect, rtol=0, atol=0)
    assert K.scatter_add_rows(src[:0], index[:0], 3).shape == (3, 3)


def test_scatter_add_reference_int8_wraps_like_torch():
    src = torch.full((3, 2), 100, dtype=torch.int8)
    out = K.scatter_add_rows(src, torch.tensor([0, 0, 0]), 1)
    assert torch.equal(out, (torch.full((1, 2), 300, dtype=torch.int32)).to(torch.int8))


@HYP
@given(
    num_src=st.integers(1, 6),
    index=st.lists(st.integers(0, 5), max_size=10),
    h=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_gather_scatter_adjoint_property(num_src, index, h, seed):
    """scatter_add_rows is the transpose of gather_rows: <gather(x), y> == <x, scatter(y)>."""
    index = torch.tensor([i % num_src for i in index], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_src, h, dtype=torch.float64, generator=g)
    y = torch.randn(index.numel(), h, dtype=torch.float64, generator=g)
    gathered = K.gather_rows(x, index)
    scattered = K.scatter_add_rows(y, index, num_src)
    torch.testing.assert_close((gathered * y).sum(), (x * scattered).sum())
    # and the dense matrix form: scatter == P.T @ y with P the one-hot gather matrix
    p = torch.nn.functional.one_hot(index, num_src).to(torch.float64)
    torch.testing.assert_close(gathered, p @ x)
    torch.testing.assert_close(scattered, p.T @ y)


# --------------------------------------------------------------------------
# Triton kernels under the interpreter (run in a subprocess, see __main__)
# --------------------------------------------------------------------------

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1e-2),  # output rounding to fp16 dominates
}
TINY = dict(block_m=16, block_n=16, block_k=16)  # tl.dot needs every block dim >= 16


def _case_grouped_mm(dtype, trans_w, counts, k, n, strided_x=False):
    def run():
        x, w, c = make_inputs(counts, k=k, n=n, trans_w=trans_w, dtype=dtype, seed=len(counts) + k)
        if strided_x:  # a non-contiguous view: x.stride() == (1, T)
            x = x.T.contiguous().T
        out = gm_mod._grouped_mm_triton(x, w, c, trans_w=trans_w, **TINY)
        assert out.dtype == dtype and out.shape == (x.shape[0], n)
        torch.testing.assert_close(out, K.grouped_mm_reference(x, w, c, trans_w=trans_w), **TOL[dtype])
    return run


def _case_weight_grad(dtype, counts, k, n):
    def run():
        x, _, c = make_inputs(counts, k=k, n=n, trans_w=True, dtype=dtype, seed=k)
        g = torch.randn(x.shape[0], n, dtype=torch.float64).to(dtype)
        out = gm_mod._grouped_mm_weight_grad_triton(g, x, c, **TINY)
        assert out.dtype == dtype and out.shape == (c.numel(), n, k)
        torch.testing.assert_close(out, K.grouped_mm_weight_grad_reference(g, x, c), **TOL[dtype])
        for e in (c == 0).nonzero().flatten().tolist():
            assert torch.count_nonzero(out[e]) == 0
    return run


def _case_zero_empty_experts(dtype):
    def run():
        out = _small_values((5, 3, 7), dtype, 3) + 1  # no zeros to begin with
        before = out.clone()
        counts = torch.tensor([0, 4, 0, 1, 0])
        gm_mod._zero_empty_experts(out, counts, block=8)  # 21 elements an expert: 3 blocks, the last partial
        assert torch.count_nonzero(out[[0, 2, 4]]) == 0
        assert torch.equal(out[[1, 3]], before[[1, 3]])
    return run


def _small_values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def _case_gather(dtype):
    def run():
        x = _small_values((9, 3, 7), dtype, 1)
        index = torch.tensor([8, 0, 3, 3, 3, 1, 7, 2, 0, 5, 4])
        out = perm_mod._gather_rows_triton(x, index, block_r=4, block_h=8)
        assert torch.equal(out, K.gather_rows_reference(x, index))  # pure copy: exact
        out32 = perm_mod._gather_rows_triton(x, index.to(torch.int32), block_r=4, block_h=8)
        assert torch.equal(out32, out)
    return run


def _case_scatter(dtype):
    def run():
        src = _small_values((11, 3, 7), dtype, 2)
        index = torch.tensor([8, 0, 3, 3, 3, 1, 7, 2, 0, 5, 3])  # rows 4, 6, 9 get nothing
        out = perm_mod._scatter_add_rows_triton(src, index, 10, block_h=8)
        ref = K.scatter_add_rows_reference(src, index, 10)
        assert out.shape == (10, 3, 7) and out.dtype == dtype
        if dtype.is_floating_point:  # same order, same fp32 accumulator
            torch.testing.assert_close(out, ref, **TOL[dtype])
        else:
            assert torch.equal(out, ref)
        assert torch.count_nonzero(out[[4, 6, 9]]) == 0
        # documented: the kernel drops out-of-range entries (the reference raises)
        bad = torch.tensor([-1, 10, 12])
        out_bad = perm_mod._scatter_add_rows_triton(torch.cat([src, src[:3]]), torch.cat([index, bad]), 10, block_h=8)
        assert torch.equal(out_bad, out)
    return run


def packed_inputs(counts, rows, hidden, inner, dtype, seed=0):
    """Assignments grouped by expert (counts[e] each), each pointing at one of `rows` token rows
    (no row twice within one expert, some rows with none), with routing weights."""
    g = torch.Generator().manual_seed(seed)
    row = torch.cat([torch.randperm(rows, generator=g)[:c] for c in counts]) if counts else torch.zeros(0, dtype=torch.int64)
    weight = torch.rand(row.numel(), generator=g, dtype=torch.float64).to(torch.float32)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype)
    gate_up = (torch.randn(len(counts), 2 * inner, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype)
    down = (torch.randn(len(counts), hidden, inner, generator=g, dtype=torch.float64) / inner**0.5).to(dtype)
    return x, row, weight, torch.tensor(counts, dtype=torch.int64), gate_up, down


def _case_packed_experts(dtype, activation, counts, rows, hidden, inner):
    def run():
        x, row, weight, c, gate_up, down = packed_inputs(counts, rows, hidden, inner, dtype, seed=len(counts))
        out = packed_mod._packed_experts_triton(x, row, weight, c, gate_up, down, activation, **TINY)
        assert out.dtype == dtype and out.shape == x.shape
        ref = K.packed_experts_reference(x.double(), row, weight.double(), c, gate_up.double(), down.double(), activation)
        torch.testing.assert_close(out.double(), ref, **TOL[dtype])
        untouched = sorted(set(range(rows)) - set(row.tolist()))
        assert torch.count_nonzero(out[untouched]) == 0  # rows with no assignment here stay zero
    return run


INTERP_CASES = {
    # several row and column tiles, an expert with no assignments, rows shared by experts
    **{
        f"packed_experts-{_dtype_id(dt)}-{act}": _case_packed_experts(dt, act, [19, 0, 7, 12], rows=24, hidden=40, inner=20)
        for dt in (torch.float32, torch.float16) for act in ("silu", "gelu")
    },
    "packed_experts-float32-relu-empty": _case_packed_experts(torch.float32, "relu", [0, 0], rows=3, hidden=8, inner=4),
    **{
        f"grouped_mm-{_dtype_id(dt)}-trans_w={tw}": _case_grouped_mm(dt, tw, [0, 5, 17, 0, 3, 9], k=40, n=37)
        for dt in (torch.float32, torch.float16) for tw in (True, False)
    },
    # many row tiles in one expert, an expert exactly one tile, E not a power of two
    "grouped_mm-float32-tiles": _case_grouped_mm(torch.float32, True, [33, 16, 0], k=16, n=16),
    "grouped_mm-float32-one-expert-strided-x": _case_grouped_mm(torch.float32, True, [20], k=5, n=3, strided_x=True),
    "grouped_mm-float32-empty": _case_grouped_mm(torch.float32, True, [0, 0], k=4, n=3),
    **{
        f"weight_grad-{_dtype_id(dt)}": _case_weight_grad(dt, [0, 5, 17, 0, 3], k=20, n=37)
        for dt in (torch.float32, torch.float16)
    },
    **{f"zero_empty_experts-{_dtype_id(dt)}": _case_zero_empty_experts(dt) for dt in (torch.float32, torch.float16)},
    **{f"gather-{_dtype_id(dt)}": _case_gather(dt) for dt in (torch.float32, torch.float16, torch.int8)},
    **{f"scatter_add-{_dtype_id(dt)}": _case_scatter(dt) for dt in (torch.float32, torch.float16, torch.int8)},
}


def _run_self(mode: str, extra_env: dict[str, str], drop_env: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, __file__, mode],
        env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreter_results():
    return _run_self("interpret", {"TRITON_INTERPRET": "1"})


@pytest.mark.parametrize("case", sorted(INTERP_CASES))
def test_triton_kernel_interpreter(interpreter_results, case):
    assert interpreter_results.get("_interpret") is True, "subprocess did not run in interpreter mode"
    assert interpreter_results[case] is None, interpreter_results[case]


# --------------------------------------------------------------------------
# ahead-of-time compile for sm_90 (no GPU needed; see __main__)
# --------------------------------------------------------------------------

def _compile_all() -> dict:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_one(kernel, ptr_types, constexprs):
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            else:
                sig[name] = ptr_types.get(name, "i32")
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32))

    results = {}

    def check(name, *args):
        try:
            compiled = compile_one(*args)
            assert compiled.asm.get("cubin"), "no cubin"
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()[-3000:]

    for dt, bk in (("fp16", 64), ("bf16", 64), ("fp32", 32)):
        ptrs = {p: f"*{dt}" for p in ("x_ptr", "w_ptr", "out_ptr", "g_ptr")}
        ptrs.update(row_offsets_ptr="*i64", tile_offsets_ptr="*i64")
        blocks = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, INPUT_PRECISION="ieee" if dt == "fp32" else "tf32")
        check(f"grouped_mm-{dt}", gm_mod._grouped_mm_kernel, ptrs, dict(blocks, BLOCK_E=64))
        if dt != "bf16":
            check(f"weight_grad-{dt}", gm_mod._grouped_mm_weight_grad_kernel, ptrs, blocks)
        check(f"zero_empty_experts-{dt}", gm_mod._zero_empty_experts_kernel, {"out_ptr": f"*{dt}", "counts_ptr": "*i64"}, dict(BLOCK=4096))
    for dt, acc in (("fp16", tl.float32), ("i8", tl.int32)):
        ptrs = dict(x_ptr=f"*{dt}", src_ptr=f"*{dt}", out_ptr=f"*{dt}", index_ptr="*i64",
                    order_ptr="*i64", seg_offsets_ptr="*i64")
        check(f"gather-{dt}", perm_mod._gather_rows_kernel, ptrs, dict(BLOCK_R=32, BLOCK_H=128))
        check(f"scatter_add-{dt}", perm_mod._scatter_add_rows_kernel, ptrs, dict(BLOCK_H=256, ACC_DTYPE=acc))
    for dt, bk in (("fp16", 64), ("bf16", 64), ("fp32", 32)):
        ptrs = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", inner_ptr=f"*{dt}", out_ptr="*fp32", row_ptr="*i64",
                    weight_ptr="*fp32", offsets_ptr="*i64", tile_offsets_ptr="*i64")
        blocks = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, BLOCK_E=64, INPUT_PRECISION="ieee" if dt == "fp32" else "tf32")
        check(f"packed_gate_up-{dt}", packed_mod._gather_gate_up_kernel, ptrs, dict(blocks, ACTIVATION=0))
        check(f"packed_down_scatter-{dt}", packed_mod._down_scatter_kernel, ptrs, blocks)
    return results


def _have_ptxas() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _have_ptxas(), reason="Triton's bundled ptxas is not available")
def test_triton_kernels_compile_for_sm90(tmp_path):
    results = _run_self(
        "compile",
        {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"},
        drop_env=("TRITON_INTERPRET",),
    )
    failed = {k: v for k, v in results.items() if v is not None}
    assert len(results) == 18 and not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())


# --------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------

GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
GPU_TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
           torch.float32: dict(rtol=1e-4, atol=1e-4)}


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=_dtype_id)
def test_packed_experts_cuda(dtype):
    x, row, weight, c, gate_up, down = packed_inputs([300, 0, 17, 190, 64], rows=400, hidden=256, inner=192, dtype=dtype)
    out = K.packed_experts(*(t.cuda() for t in (x, row, weight, c, gate_up, down)), "silu")
    assert out.is_cuda and out.dtype == dtype
    ref = K.packed_experts_reference(x.double(), row, weight.double(), c, gate_up.double(), down.double(), "silu")
    torch.testing.assert_close(out.double().cpu(), ref, **GPU_TOL[dtype])


@gpu
@requires_cuda
@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=_dtype_id)
def test_grouped_mm_cuda(dtype, trans_w):
    counts = [0, 300, 17, 0, 1, 190, 64]
    x, w, c = make_inputs(counts, k=192, n=320, trans_w=trans_w, dtype=dtype)
    xc, wc, cc = x.cuda(), w.cuda(), c.cuda()
    torch.cuda.set_sync_debug_mode("error")  # the dispatcher must not read counts on the host
    try:
        out = K.grouped_mm(xc, wc, cc, trans_w=trans_w)
        gw = K.grouped_mm_weight_grad(out, xc, cc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = K.grouped_mm_reference(x, w, c, trans_w=trans_w)
    torch.testing.assert_close(out.cpu(), ref, **GPU_TOL[dtype])
    ref_gw = K.grouped_mm_weight_grad_reference(out.cpu(), x, c)
    scale = ref_gw.float().abs().max().item()
    torch.testing.assert_close(gw.cpu().float() / scale, ref_gw.float() / scale, **GPU_TOL[dtype])


@gpu
@requires_cuda
@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("k, n, cublas", [(192, 320, True), (190, 320, False), (192, 318, False)])
def test_grouped_mm_takes_cublas_where_bf16_layout_fits(k, n, cublas, trans_w, monkeypatch):
    """bf16 with 16-byte strides runs torch._grouped_mm (offsets from the counts on the
    device, no host sync) for the output and the weight gradient, and equals the reference
    and the Triton kernel, experts with no rows included (their weight gradient exactly 0);
    widths cuBLAS cannot take fall back to Triton."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    counts = [0, 301, 17, 0, 1, 190, 63]
    x, w, c = make_inputs(counts, k=k, n=n, trans_w=trans_w, dtype=torch.bfloat16, seed=3)
    xc, wc, cc = x.cuda(), w.cuda(), c.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = K.grouped_mm(xc, wc, cc, trans_w=trans_w)
        grad = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16)
        gw = K.grouped_mm_weight_grad(grad, xc, cc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    forward_fits = gm_mod._cublas_fits(xc, wc.transpose(-2, -1) if trans_w else wc, out_cols=n)
    assert forward_fits == cublas
    assert len(calls) == int(forward_fits) + int(gm_mod._cublas_fits(grad.t(), xc, out_cols=k))
    assert out.dtype == gw.dtype == torch.bfloat16
    ref = K.grouped_mm_reference(x.double(), w.double(), c, trans_w=trans_w)
    torch.testing.assert_close(out.cpu().double(), ref, **GPU_TOL[torch.bfloat16])
    triton_out = gm_mod._grouped_mm_triton(xc, wc, cc, trans_w=trans_w)
    torch.testing.assert_close(out, triton_out, **GPU_TOL[torch.bfloat16])
    ref_gw = K.grouped_mm_weight_grad_reference(grad.cpu().double(), x.double(), c)
    scale = ref_gw.abs().max().item()
    torch.testing.assert_close(gw.cpu().double() / scale, ref_gw / scale, **GPU_TOL[torch.bfloat16])
    assert not gw[0].any() and not gw[3].any(), "an expert with no rows gets a zero gradient"


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES + [torch.int8], ids=_dtype_id)
def test_permute_cuda(dtype):
    x = _small_values((257, 3, 70), dtype, 3).cuda()
    index = torch.randint(0, 257, (1000,)).cuda()
    torch.testing.assert_close(K.gather_rows(x, index).cpu(), K.gather_rows_reference(x.cpu(), index.cpu()),
                               rtol=0, atol=0)
    src = _small_values((1000, 3, 70), dtype, 4).cuda()
    out = K.scatter_add_rows(src, index, 300)
    ref = K.scatter_add_rows_reference(src.cpu(), index.cpu(), 300)
    tol = dict(rtol=0, atol=0) if not dtype.is_floating_point else GPU_TOL[dtype]
    torch.testing.assert_close(out.cpu(), ref, **tol)
    assert torch.equal(K.scatter_add_rows(src, index, 300), out)  # deterministic


# --------------------------------------------------------------------------
# subprocess entry point
# --------------------------------------------------------------------------

def _interpret_all() -> dict:
    from triton.runtime.interpreter import InterpretedFunction

    results = {"_interpret": isinstance(gm_mod._grouped_mm_kernel, InterpretedFunction)}
    for name, case in INTERP_CASES.items():
        try:
            case()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode = sys.argv[1]
    res = _interpret_all() if mode == "interpret" else _compile_all()
    print("RESULTS " + json.dumps(res))
