"""Row permutation kernels of MoE dispatch (gather) and combine (scatter-add).

gather_rows(x, index)[i] = x[index[i]]
scatter_add_rows(src, index, num_rows)[r] = sum of src[i] over i with index[i] == r

Rows may have any trailing shape; it is flattened to one dimension H.
Indices must lie in [0, len(x)) resp. [0, num_rows): the references raise
otherwise; the gather kernel checks only under Triton's debug mode and the
scatter kernel drops out-of-range entries (a check would cost a device sync).

Summation order of scatter_add_rows is deterministic on both paths: every
output row adds its sources in increasing i.  Floating half types accumulate
in fp32, integers in int32 (int64 for int64) and wrap to the output dtype like
torch integer arithmetic does.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

__all__ = ["gather_rows", "gather_rows_reference", "scatter_add_rows", "scatter_add_rows_reference"]

# Triton accumulator dtype per element dtype; dtypes not listed take the reference.
_ACC_DTYPE = {
    torch.float16: tl.float32, torch.bfloat16: tl.float32, torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int8: tl.int32, torch.uint8: tl.int32, torch.int16: tl.int32, torch.int32: tl.int32,
    torch.int64: tl.int64,
}


def _check_index(index: Tensor) -> None:
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"index must be a 1-d int32/int64 tensor, got {index.dtype} {tuple(index.shape)}")


# --------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------

def gather_rows_reference(x: Tensor, index: Tensor) -> Tensor:
    _check_index(index)
    return x.index_select(0, index.to(device=x.device, dtype=torch.int64))


def scatter_add_rows_reference(src: Tensor, index: Tensor, num_rows: int) -> Tensor:
    _check_index(index)
    if index.shape[0] != src.shape[0]:
        raise ValueError(f"index has {index.shape[0]} entries but src has {src.shape[0]} rows")
    # index_add_ on CPU adds in increasing i, the order the kernel uses too.
    acc_dtype = torch.float32 if src.dtype in (torch.float16, torch.bfloat16) else src.dtype
    out = src.new_zeros((num_rows, *src.shape[1:]), dtype=acc_dtype)
    out.index_add_(0, index.to(device=src.device, dtype=torch.int64), src.to(acc_dtype))
    return out.to(src.dtype)


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------

@triton.jit
def _gather_rows_kernel(
    x_ptr, index_ptr, out_ptr,
    R, H, num_src_rows,
    stride_xr, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Copy a [BLOCK_R, BLOCK_H] tile of output rows from their source rows.

    Pure data movement: each output element is read once and written once, so
    a plain 2-D tile grid is all it needs.  Rows are contiguous in H.
    """
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    r_mask = rs < R
    mask = r_mask[:, None] & (hs < H)[None, :]

    src_rows = tl.load(index_ptr + rs, mask=r_mask, other=0).to(tl.int64)
    in_range = (src_rows >= 0) & (src_rows < num_src_rows)
    tl.device_assert(in_range | ~r_mask, "gather_rows: index out of range")  # debug mode only
    vals = tl.load(x_ptr + src_rows[:, None] * stride_xr + hs[None, :], mask=mask)
    tl.store(out_ptr + rs.to(tl.int64)[:, None] * stride_or + hs[None, :], vals, mask=mask)


@triton.jit
def _scatter_add_rows_kernel(
    src_ptr, order_ptr, seg_offsets_ptr, out_ptr,
    H,
    stride_sr, stride_or,
    BLOCK_H: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    """Output row r = sum of the source rows routed to it, in increasing order.

    Why not atomics: atomic adds make float results depend on scheduling and
    do not exist for int8/fp16 on every GPU.  Instead the host stable-sorts the
    index once (on device), so the sources of output row r are
    order[seg_offsets[r]:seg_offsets[r + 1]]; one program owns a slice of one
    output row, sums them in a register accumulator, and writes once (rows
    nobody routes to get zeros).
    """
    r = tl.program_id(0)
    pid_h = tl.program_id(1)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hs < H

    seg_start = tl.load(seg_offsets_ptr + r)
    seg_end = tl.load(seg_offsets_ptr + r + 1)
    acc = tl.zeros((BLOCK_H,), dtype=ACC_DTYPE)
    for j in range(seg_start, seg_end):
        i = tl.load(order_ptr + j)  # stable sort: i increases with j
        acc += tl.load(src_ptr + i * stride_sr + hs, mask=h_mask, other=0).to(ACC_DTYPE)
    # Narrowing cast wraps integers (two's complement), as torch does.
    tl.store(out_ptr + r.to(tl.int64) * stride_or + hs, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


# --------------------------------------------------------------------------
# launchers (called directly by the interpreter tests with CPU tensors)
# --------------------------------------------------------------------------

def _as_rows(t: Tensor) -> Tensor:
    """View as [rows, H] with contiguous rows (copies only if needed)."""
    t2 = t.reshape(t.shape[0], -1)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _gather_rows_triton(x: Tensor, index: Tensor, *, block_r: int = 32, block_h: int = 128) -> Tensor:
    _check_index(index)
    x2 = _as_rows(x)
    r, h = index.shape[0], x2.shape[1]
    out = x.new_empty((r, h))
    if out.numel() > 0:
        grid = (triton.cdiv(r, block_r), triton.cdiv(h, block_h))
        _gather_rows_kernel[grid](
            x2, index.to(x.device), out, r, h, x2.shape[0], x2.stride(0), out.stride(0),
            BLOCK_R=block_r, BLOCK_H=block_h,
        )
    return out.view(r, *x.shape[1:])


def _scatter_add_rows_triton(src: Tensor, index: Tensor, num_rows: int, *, block_h: int = 256) -> Tensor:
    _check_index(index)
    if index.shape[0] != src.shape[0]:
        raise ValueError(f"index has {index.shape[0]} entries but src has {src.shape[0]} rows")
    s2 = _as_rows(src)
    h = s2.shape[1]
    out = src.new_empty((num_rows, h))
    if out.numel() > 0:
        index = index.to(device=src.device, dtype=torch.int64)
        sorted_index, order = torch.sort(index, stable=True)
        # seg_offsets[r] = number of entries < r, so row r's sources are
        # order[seg_offsets[r]:seg_offsets[r + 1]].  searchsorted (unlike
        # bincount) needs no host sync; out-of-range entries fall outside
        # every segment and are dropped.
        rows = torch.arange(num_rows + 1, dtype=torch.int64, device=src.device)
        seg_offsets = torch.searchsorted(sorted_index, rows)
        grid = (num_rows, triton.cdiv(h, block_h))
        _scatter_add_rows_kernel[grid](
            s2, order, seg_offsets, out, h, s2.stride(0), out.stride(0),
            BLOCK_H=block_h, ACC_DTYPE=_ACC_DTYPE[src.dtype],
        )
    return out.view(num_rows, *src.shape[1:])


# --------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------

def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """out[i] = x[index[i]].  CUDA -> Triton kernel, CPU -> index_select."""
    if x.is_cuda and x.dtype in _ACC_DTYPE:
        return _gather_rows_triton(x, index)
    return gather_rows_reference(x, index)


def scatter_add_rows(src: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """out = zeros(num_rows, H); out[index[i]] += src[i], deterministic order."""
    if src.is_cuda and src.dtype in _ACC_DTYPE:
        return _scatter_add_rows_triton(src, index, num_rows)
    return scatter_add_rows_reference(src, index, num_rows)
