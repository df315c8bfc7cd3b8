"""Embedding-row kernels of sparse embedding communication (EmbRace).

coalesce_rows(ids, rows, padding_idx) -> (unique_ids, summed)
    unique_ids: the distinct ids of `ids` in increasing order (padding_idx left out);
    summed[u] = sum of rows[i] over i with ids[i] == unique_ids[u], in increasing i.
    This is what a rank sends instead of a dense table gradient: one row per touched id.

accumulate_rows(table, ids, rows) -> table (in place)
    table[ids[i]] += rows[i], in increasing i: the owner-side update of a row-sharded
    table's gradient (ids are local row numbers) or of a replicated table's dense
    gradient from the (id, row) pairs every rank sent.

Both are deterministic (fixed summation order) on both paths, so every rank that applies
the same pairs gets the same bits. The sort that finds unique ids stays in torch (a stable
sort); the Triton kernels do the row arithmetic: one program per (unique id, column
block) walks its run of the sorted order and sums the rows. Floating half types
accumulate in fp32. CUDA tensors take the Triton path, CPU tensors the torch reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

__all__ = ["accumulate_rows", "accumulate_rows_reference", "coalesce_rows", "coalesce_rows_reference"]

_ACC_DTYPE = {torch.float16: tl.float32, torch.bfloat16: tl.float32, torch.float32: tl.float32, torch.float64: tl.float64}


def _check(ids: Tensor, rows: Tensor) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be a 1-d int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if rows.dim() != 2 or rows.shape[0] != ids.shape[0]:
        raise ValueError(f"rows must be [len(ids), H] = [{ids.shape[0]}, H], got {tuple(rows.shape)}")


def _sorted_runs(ids: Tensor, padding_idx: int) -> tuple[Tensor, Tensor, Tensor]:
    """(unique ids, start of each id's run in `order`, order): the stable sort both paths share."""
    ids = ids.to(torch.int64)
    keep = torch.arange(ids.shape[0], device=ids.device)
    if padding_idx >= 0:
        keep = keep[ids != padding_idx]
    sorted_ids, position = torch.sort(ids[keep], stable=True)
    order = keep[position]
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.zeros(unique.shape[0] + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=starts[1:])
    return unique, starts, order


# --------------------------------------------------------------------------- references


def coalesce_rows_reference(ids: Tensor, rows: Tensor, padding_idx: int = -1) -> tuple[Tensor, Tensor]:
    _check(ids, rows)
    unique, starts, order = _sorted_runs(ids, padding_idx)
    acc_dtype = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    segment = torch.repeat_interleave(torch.arange(unique.shape[0], device=ids.device), starts.diff())
    summed = rows.new_zeros((unique.shape[0], rows.shape[1]), dtype=acc_dtype)
    # index_add_ on CPU adds in increasing position; positions are in increasing i per id.
    summed.index_add_(0, segment, rows[order].to(acc_dtype))
    return unique, summed.to(rows.dtype)


def accumulate_rows_reference(table: Tensor, ids: Tensor, rows: Tensor) -> Tensor:
    _check(ids, rows)
    if rows.shape[1:] != table.shape[1:]:
        raise ValueError(f"rows {tuple(rows.shape)} do not fit table rows {tuple(table.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise IndexError(f"row ids must lie in [0, {table.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]")
    acc_dtype = torch.float32 if table.dtype in (torch.float16, torch.bfloat16) else table.dtype
    if acc_dtype == table.dtype:
        return table.index_add_(0, ids.to(torch.int64), rows.to(table.dtype))
    acc = table.to(acc_dtype).index_add_(0, ids.to(torch.int64), rows.to(acc_dtype))
    return table.copy_(acc)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _segment_sum_kernel(
    rows_ptr, order_ptr, starts_ptr, out_ptr,
    H, stride_r, stride_o,
    ACC: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[u, cols] = sum of rows[order[j], cols] for j in [starts[u], starts[u+1]), in j order."""
    u = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    begin = tl.load(starts_ptr + u)
    end = tl.load(starts_ptr + u + 1)
    acc = tl.zeros((BLOCK_H,), dtype=ACC)
    for j in range(begin, end):
        source = tl.load(order_ptr + j)
        acc += tl.load(rows_ptr + source * stride_r + cols, mask=mask, other=0).to(ACC)
    tl.store(out_ptr + u * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _accumulate_kernel(
    table_ptr, rows_ptr, order_ptr, starts_ptr, targets_ptr,
    H, stride_t, stride_r,
    ACC: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """table[targets[u], cols] += rows[order[j], cols] for the run of u, in j order (one writer per row)."""
    u = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    begin = tl.load(starts_ptr + u)
    end = tl.load(starts_ptr + u + 1)
    target = tl.load(targets_ptr + u)
    acc = tl.load(table_ptr + target * stride_t + cols, mask=mask, other=0).to(ACC)
    for j in range(begin, end):
        source = tl.load(order_ptr + j)
        acc += tl.load(rows_ptr + source * stride_r + cols, mask=mask, other=0).to(ACC)
    tl.store(table_ptr + target * stride_t + cols, acc.to(table_ptr.dtype.element_ty), mask=mask)


def _block_h(h: int) -> int:
    return min(256, triton.next_power_of_2(max(h, 1)))


def coalesce_rows_triton(ids: Tensor, rows: Tensor, padding_idx: int = -1) -> tuple[Tensor, Tensor]:
    _check(ids, rows)
    rows = rows.contiguous()
    unique, starts, order = _sorted_runs(ids, padding_idx)
    out = rows.new_empty((unique.shape[0], rows.shape[1]))
    if unique.numel() and rows.shape[1]:
        block = _block_h(rows.shape[1])
        grid = (unique.shape[0], triton.cdiv(rows.shape[1], block))
        _segment_sum_kernel[grid](
            rows, order, starts, out, rows.shape[1], rows.stride(0), out.stride(0), ACC=_ACC_DTYPE[rows.dtype], BLOCK_H=block
        )
    return unique, out


def accumulate_rows_triton(table: Tensor, ids: Tensor, rows: Tensor) -> Tensor:
    _check(ids, rows)
    if not table.is_contiguous():
        raise ValueError("accumulate_rows needs a contiguous table")
    rows = rows.contiguous()
    targets, starts, order = _sorted_runs(ids, -1)
    if targets.numel() and rows.shape[1]:
        block = _block_h(rows.shape[1])
        grid = (targets.shape[0], triton.cdiv(rows.shape[1], block))
        _accumulate_kernel[grid](
            table, rows, order, starts, targets, rows.shape[1], table.stride(0), rows.stride(0),
            ACC=_ACC_DTYPE[table.dtype], BLOCK_H=block,
        )
    return table


# --------------------------------------------------------------------------- dispatch


def coalesce_rows(ids: Tensor, rows: Tensor, padding_idx: int = -1) -> tuple[Tensor, Tensor]:
    if rows.is_cuda and rows.dtype in _ACC_DTYPE:
        return coalesce_rows_triton(ids, rows, padding_idx)
    return coalesce_rows_reference(ids, rows, padding_idx)


def accumulate_rows(table: Tensor, ids: Tensor, rows: Tensor) -> Tensor:
    if table.is_cuda and table.dtype in _ACC_DTYPE:
        return accumulate_rows_triton(table, ids, rows)
    return accumulate_rows_reference(table, ids, rows)
