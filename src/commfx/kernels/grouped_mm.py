"""Grouped (per-expert) matrix multiply for MoE expert computation.

Rows of ``x`` are grouped contiguously by expert, ``counts[e]`` rows each, and
every group is multiplied by its own weight matrix.  On CUDA, bf16 operands in
cuBLAS's layout run as cuBLAS's grouped GEMM (``torch._grouped_mm``, offsets from
the counts' cumulative sum on the device), other CUDA operands as one Triton launch
over all experts; on CPU (and for dtypes the kernels do not
cover, e.g. float64 on CUDA) it runs the torch reference's products written in place
into one output; the reference itself is the float64 ground truth the project's
exactness checks use.

Backward of ``out = grouped_mm(x, w, counts)`` (trans_w=True, w [E, N, K]):
    grad_x = grouped_mm(grad_out, w, counts, trans_w=False)
    grad_w = grouped_mm_weight_grad(grad_out, x, counts)
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

import triton
import triton.language as tl

__all__ = [
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_mm_weight_grad",
    "grouped_mm_weight_grad_reference",
]

# dtypes the Triton kernels handle; anything else takes the CPU kernels below.
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------
# torch references (the ground truth in tests)
# --------------------------------------------------------------------------

def _check_args(x: Tensor, w: Tensor, counts: Tensor, trans_w: bool) -> tuple[int, int]:
    """Validate shapes; return (N, K).  Never reads tensor values (no sync)."""
    if x.dim() != 2 or w.dim() != 3 or counts.dim() != 1:
        raise ValueError(
            f"expected x [T, K], w [E, ., .], counts [E]; got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(counts.shape)}"
        )
    if w.shape[0] != counts.shape[0]:
        raise ValueError(f"w has {w.shape[0]} experts but counts has {counts.shape[0]}")
    if w.shape[0] == 0 and x.shape[0] > 0:
        raise ValueError(f"{x.shape[0]} rows but no experts")
    if x.dtype != w.dtype:
        raise TypeError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
    if counts.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"counts must be an integer tensor, got {counts.dtype}")
    n, k = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} but w expects K={k} (trans_w={trans_w})")
    return n, k


def _split_counts(counts: Tensor, total: int, padded: bool = False) -> list[int]:
    """counts on the host; they must sum to `total` rows, or to at most that where the
    rows past their sum are padding."""
    sizes = counts.tolist()
    used = sum(sizes)
    if any(c < 0 for c in sizes) or used > total or (used != total and not padded):
        raise ValueError(f"counts {sizes} must be non-negative and sum to {total}" + (" or less" if padded else ""))
    return sizes


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half types accumulate in fp32, like the kernels; fp32/fp64 compute as is.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def grouped_mm_reference(x: Tensor, w: Tensor, counts: Tensor, *, trans_w: bool = True) -> Tensor:
    """Per-expert loop: out[rows of e] = x_e @ w[e].T (trans_w) or x_e @ w[e]."""
    n, _ = _check_args(x, w, counts, trans_w)
    sizes = _split_counts(counts, x.shape[0])
    ct = _compute_dtype(x.dtype)
    outs = []
    for e, x_e in enumerate(torch.split(x, sizes)):
        w_e = w[e].to(ct)
        outs.append(x_e.to(ct) @ (w_e.T if trans_w else w_e))
    if not outs:  # E == 0 (then T == 0 too)
        return x.new_empty((0, n))
    return torch.cat(outs).to(x.dtype)


def grouped_mm_weight_grad_reference(grad_out: Tensor, x: Tensor, counts: Tensor) -> Tensor:
    """[e] = grad_out_e.T @ x_e, zeros for an expert with no rows."""
    _check_weight_grad_args(grad_out, x)
    sizes = _split_counts(counts, x.shape[0])
    ct = _compute_dtype(x.dtype)
    out = x.new_zeros((len(sizes), grad_out.shape[1], x.shape[1]), dtype=ct)
    for e, (g_e, x_e) in enumerate(zip(torch.split(grad_out, sizes), torch.split(x, sizes))):
        out[e] = g_e.to(ct).T @ x_e.to(ct)  # [N, 0] @ [0, K] is zeros for an empty expert
    return out.to(x.dtype)


def _check_weight_grad_args(grad_out: Tensor, x: Tensor) -> None:
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"expected grad_out [T, N], x [T, K]; got {tuple(grad_out.shape)}, {tuple(x.shape)}")
    if grad_out.dtype != x.dtype:
        raise TypeError(f"grad_out and x dtypes differ: {grad_out.dtype} vs {x.dtype}")


# --------------------------------------------------------------------------
# CPU kernels: the references' products, each written in place into the output
# (no per-expert results joined by a copy); not differentiable, as the other kernels
# --------------------------------------------------------------------------

def _grouped_mm_cpu(x: Tensor, w: Tensor, counts: Tensor, trans_w: bool, padded: bool) -> Tensor:
    """grouped_mm_reference's products into one output; with `padded`, rows past
    sum(counts) come out zero."""
    n, _ = _check_args(x, w, counts, trans_w)
    sizes = _split_counts(counts, x.shape[0], padded)
    ct = _compute_dtype(x.dtype)
    out = x.new_empty((x.shape[0], n), dtype=ct)
    xc, wc = x.to(ct), w.to(ct)  # once, not per expert (no-ops in the compute dtype)
    start = 0
    for e, size in enumerate(sizes):
        if size:  # an expert with no rows writes nothing
            torch.mm(xc[start : start + size], wc[e].T if trans_w else wc[e], out=out[start : start + size])
        start += size
    out[start:].zero_()
    return out.to(x.dtype)


def _grouped_mm_weight_grad_cpu(grad_out: Tensor, x: Tensor, counts: Tensor, padded: bool) -> Tensor:
    """grouped_mm_weight_grad_reference's products written into each expert's slice; with
    `padded`, rows past sum(counts) add nothing."""
    _check_weight_grad_args(grad_out, x)
    sizes = _split_counts(counts, x.shape[0], padded)
    ct = _compute_dtype(x.dtype)
    out = x.new_empty((len(sizes), grad_out.shape[1], x.shape[1]), dtype=ct)
    gc, xc = grad_out.to(ct), x.to(ct)  # once, not per expert (no-ops in the compute dtype)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            torch.mm(gc[start : start + size].T, xc[start : start + size], out=out[e])
        else:
            out[e].zero_()  # an expert with no rows gets no gradient
        start += size
    return out.to(x.dtype)


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------

@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, out_ptr,
    row_offsets_ptr,   # [E + 1] exclusive prefix sum of counts: rows of expert e
    tile_offsets_ptr,  # [E + 1] exclusive prefix sum of cdiv(counts, BLOCK_M)
    N, K, E,
    stride_xm, stride_xk,
    stride_we, stride_wk, stride_wn,  # w[e] seen as a [K, N] operand, whatever its layout
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= E
    INPUT_PRECISION: tl.constexpr,
):
    """One program computes one [BLOCK_M, BLOCK_N] tile of one expert's output.

    Why this shape: the launch must cover all experts at once (one launch per
    expert costs more than the GEMMs at MoE sizes) without reading counts on
    the host (a device sync each step).  So the host launches an upper bound of
    row tiles, cdiv(T, BLOCK_M) + E, and each program finds its expert by
    searching the device-side prefix sum of per-expert row-tile counts; spare
    programs exit.  A row tile never straddles two experts, so rows past the
    expert's end are masked, and w[e] is a single matrix for the whole tile.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    # Expert owning row tile pid_m = number of experts whose tiles end at or
    # before pid_m.  Experts with zero rows end where the previous one does,
    # so they are skipped without special casing.
    e_idx = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_offsets_ptr + 1 + e_idx, mask=e_idx < E, other=0)
    expert = tl.sum(((tile_ends <= pid_m) & (e_idx < E)).to(tl.int32), axis=0)
    if expert >= E:
        return  # spare program: the grid is an upper bound on the tile count

    tile_start = tl.load(tile_offsets_ptr + expert)
    row_end = tl.load(row_offsets_ptr + expert + 1)
    row_start = tl.load(row_offsets_ptr + expert) + (pid_m - tile_start) * BLOCK_M

    rows = row_start + tl.arange(0, BLOCK_M).to(tl.int64)  # int64: T * K may exceed 2**31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < row_end
    col_mask = cols < N

    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_mm_weight_grad_kernel(
    g_ptr, x_ptr, out_ptr,
    row_offsets_ptr,  # [E + 1] exclusive prefix sum of counts
    N, K,
    stride_gm, stride_gn,
    stride_xm, stride_xk,
    stride_oe, stride_on, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """One program computes one [BLOCK_N, BLOCK_K] tile of grad_w[e].

    Here the ragged dimension is the reduction, so no tile schedule is needed:
    the grid is (E, N tiles, K tiles) and each program loops over its expert's
    rows.  An expert with no rows runs zero iterations and stores zeros.
    Imbalanced routing makes some programs loop longer (no split over rows).
    """
    expert = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    row_start = tl.load(row_offsets_ptr + expert)
    row_end = tl.load(row_offsets_ptr + expert + 1)

    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M).to(tl.int64)
    n_mask = ns < N
    k_mask = ks < K

    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + ms
        m_mask = rows < row_end
        # grad_out tile loaded already transposed: [BLOCK_N, BLOCK_M]
        g = tl.load(g_ptr + ns[:, None] * stride_gn + rows[None, :] * stride_gm,
                    mask=n_mask[:, None] & m_mask[None, :], other=0.0)
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(g, a, acc, input_precision=INPUT_PRECISION)

    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + ns[:, None] * stride_on + ks[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


@triton.jit
def _zero_empty_experts_kernel(out_ptr, counts_ptr, per_expert, BLOCK: tl.constexpr):
    """Zero out[e] (per_expert contiguous elements) where counts[e] == 0; every other
    program reads one count and exits, so the pass costs a launch, not a sweep of out."""
    expert = tl.program_id(0)
    if tl.load(counts_ptr + expert) != 0:
        return
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    base = out_ptr + expert.to(tl.int64) * per_expert
    tl.store(base + offsets, tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty), mask=offsets < per_expert)


# --------------------------------------------------------------------------
# launchers (called directly by the interpreter tests with CPU tensors)
# --------------------------------------------------------------------------

def _input_precision(dtype: torch.dtype) -> str:
    # fp32 follows torch's matmul setting: TF32 only if the user allowed it.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored by tl.dot for fp16/bf16 operands


def _default_blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    # Untuned defaults (no autotune so the same code runs under the interpreter).
    return (64, 128, 32) if dtype == torch.float32 else (64, 128, 64)


def _weight_grad_config(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M rows contracted, BLOCK_N, BLOCK_K, warps, stages) for the weight-gradient
    kernel. 16-bit: a 128 x 256 output tile, 8 warps, chosen on an H200 at Mixtral-8x7B
    widths (0.79-0.82 of the bf16 floor against 0.38 for the forward's blocks,
    benchmarks/log/2026-11-28-gpu_weight_grad_h200.jsonl); float32's tile must fit shared memory."""
    if dtype == torch.float32:
        return (*_default_blocks(dtype), 4, 3)
    return 64, 128, 256, 8, 3


def _exclusive_cumsum(t: Tensor) -> Tensor:
    out = torch.zeros(t.numel() + 1, dtype=torch.int64, device=t.device)
    torch.cumsum(t, 0, out=out[1:])
    return out


def _grouped_mm_triton(
    x: Tensor, w: Tensor, counts: Tensor, *, trans_w: bool = True,
    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
) -> Tensor:
    n, k = _check_args(x, w, counts, trans_w)
    t, e = x.shape[0], w.shape[0]
    out = x.new_empty((t, n))
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk = _default_blocks(x.dtype)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk

    counts = counts.to(device=x.device, dtype=torch.int64)
    row_offsets = _exclusive_cumsum(counts)
    tile_offsets = _exclusive_cumsum((counts + bm - 1) // bm)
    # w[e] as the [K, N] right operand: transposing is just swapping strides.
    stride_wk, stride_wn = (w.stride(2), w.stride(1)) if trans_w else (w.stride(1), w.stride(2))
    grid = (triton.cdiv(t, bm) + e, triton.cdiv(n, bn))
    _grouped_mm_kernel[grid](
        x, w, out, row_offsets, tile_offsets,
        n, k, e,
        x.stride(0), x.stride(1),
        w.stride(0), stride_wk, stride_wn,
        out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=triton.next_power_of_2(e),
        INPUT_PRECISION=_input_precision(x.dtype),
    )
    return out


def _grouped_mm_weight_grad_triton(
    grad_out: Tensor, x: Tensor, counts: Tensor, *,
    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
) -> Tensor:
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"expected grad_out [T, N], x [T, K]; got {tuple(grad_out.shape)}, {tuple(x.shape)}")
    if grad_out.dtype != x.dtype:
        raise TypeError(f"grad_out and x dtypes differ: {grad_out.dtype} vs {x.dtype}")
    e, n, k = counts.shape[0], grad_out.shape[1], x.shape[1]
    out = x.new_empty((e, n, k))
    if out.numel() == 0:
        return out
    bm, bn, bk, warps, stages = _weight_grad_config(x.dtype)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    row_offsets = _exclusive_cumsum(counts.to(device=x.device, dtype=torch.int64))
    grid = (e, triton.cdiv(n, bn), triton.cdiv(k, bk))
    _grouped_mm_weight_grad_kernel[grid](
        grad_out, x, out, row_offsets,
        n, k,
        grad_out.stride(0), grad_out.stride(1),
        x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        INPUT_PRECISION=_input_precision(x.dtype),
        num_warps=warps, num_stages=stages,
    )
    return out


def _zero_empty_experts(out: Tensor, counts: Tensor, *, block: int = 4096) -> Tensor:
    """out[e] = 0 in place for every expert with no rows, reading counts on the device."""
    if not out.is_contiguous():
        raise ValueError(f"expected a contiguous [E, ...] gradient, got strides {out.stride()}")
    experts = out.shape[0]
    per_expert = out[0].numel() if experts else 0
    if per_expert == 0:
        return out
    counts = counts.to(device=out.device, dtype=torch.int64)
    _zero_empty_experts_kernel[(experts, triton.cdiv(per_expert, block))](out, counts, per_expert, BLOCK=block)
    return out


# --------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------

def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, *, trans_w: bool = True, padded: bool = False) -> Tensor:
    """[T, K] x per-expert weights -> [T, N]; rows grouped by expert per ``counts``.

    w is [E, N, K] if trans_w (F.linear layout, out = x_e @ w[e].T) else
    [E, K, N] (out = x_e @ w[e]).  CUDA bf16 with cuBLAS's layout -> torch._grouped_mm;
    other CUDA fp16/bf16/fp32 -> Triton (neither syncs with the host; counts are not
    validated); everything else -> the reference's products in place. `padded`: rows past sum(counts) belong
    to no expert (the reference writes zeros there; the CUDA kernels leave them unwritten).
    """
    if x.is_cuda and x.dtype in _TRITON_DTYPES:
        w_kn = w.transpose(-2, -1) if trans_w else w
        if x.shape[0] > 0 and _cublas_fits(x, w_kn, out_cols=w_kn.shape[-1]):
            _check_args(x, w, counts, trans_w)
            return _grouped_mm_cublas(x, w_kn, counts)
        return _grouped_mm_triton(x, w, counts, trans_w=trans_w)
    return _grouped_mm_cpu(x, w, counts, trans_w, padded)


def grouped_mm_weight_grad(grad_out: Tensor, x: Tensor, counts: Tensor, *, padded: bool = False) -> Tensor:
    """[E, N, K] with [e] = grad_out_e.T @ x_e: grad of w in grouped_mm(trans_w=True).
    `padded`: rows past sum(counts) add nothing."""
    if x.is_cuda and x.dtype in _TRITON_DTYPES:
        if x.shape[0] > 0 and grad_out.dim() == 2 and _cublas_fits(grad_out.t(), x, out_cols=x.shape[-1]):
            return _grouped_mm_weight_grad_cublas(grad_out, x, counts)
        return _grouped_mm_weight_grad_triton(grad_out, x, counts)
    return _grouped_mm_weight_grad_cpu(grad_out, x, counts, padded)


# --------------------------------------------------------------------------
# cuBLAS grouped GEMM (torch._grouped_mm): bf16 at the roofline on sm80+
# --------------------------------------------------------------------------

def _offsets(counts: Tensor, device: torch.device) -> Tensor:
    """int32 inclusive cumulative sum of counts (the groups' ends), computed on the device."""
    return torch.cumsum(counts.to(device=device), 0, dtype=torch.int32)


def _cublas_fits(*mats: Tensor, out_cols: int) -> bool:
    """Whether torch._grouped_mm takes these operands: bf16 on a CUDA device of compute
    capability 8.0 or more, 16-byte aligned base pointers, and each matrix row- or
    column-major in its last two dims with a 16-byte multiple leading stride (what
    aten's _grouped_mm_cuda checks); `out_cols` (the output's last dim) a 16-byte
    multiple too, or the library pads the output's rows. Reads no tensor values."""
    if not hasattr(torch, "_grouped_mm") or out_cols % (16 // torch.bfloat16.itemsize):
        return False
    for m in mats:
        if m.dtype != torch.bfloat16 or not m.is_cuda or m.data_ptr() % 16 or m.dim() not in (2, 3):
            return False
        rows, cols = m.shape[-2], m.shape[-1]
        s_rows, s_cols = m.stride(-2), m.stride(-1)
        align = 16 // m.element_size()
        if s_cols == 1 and s_rows >= max(1, cols):
            lead = s_rows
        elif s_rows == 1 and s_cols >= max(1, rows):
            lead = s_cols
        else:
            return False
        if lead % align:
            return False
    return _capability(mats[0].device) >= (8, 0)


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


def _grouped_mm_cublas(x: Tensor, w_kn: Tensor, counts: Tensor) -> Tensor:
    """out[rows of e] = x_e @ w_kn[e] with w_kn [E, K, N]: one cuBLAS grouped GEMM."""
    return torch._grouped_mm(x, w_kn, offs=_offsets(counts, x.device))


def _grouped_mm_weight_grad_cublas(grad_out: Tensor, x: Tensor, counts: Tensor) -> Tensor:
    """[e] = grad_out_e.T @ x_e: the rows are the contraction, grouped by `counts`. An expert
    with no rows gets zeros, whatever the library leaves there: written by a kernel that
    touches only those experts (a masked fill of the whole gradient cost a quarter of the
    GEMM's time on an H200)."""
    if grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"expected grad_out [T, N], x [T, K]; got {tuple(grad_out.shape)}, {tuple(x.shape)}")
    out = torch._grouped_mm(grad_out.t(), x, offs=_offsets(counts, x.device))
    return _zero_empty_experts(out, counts)
