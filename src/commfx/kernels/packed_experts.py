"""A device's packed experts as one fused computation (Lina's expert packing, the kernel).

After the packed dispatch a rank holds V token rows, one per (token, this rank), each with
up to k (local expert, routing weight) assignments. The unfused path lays the rows out by
expert (a gather), runs the grouped expert FFN, and sums each row's weighted expert
outputs (the combine). Here both GEMMs read and write through the assignment list
instead:

    inner[a] = act(x[row[a]] @ gate[e]^T) * (x[row[a]] @ up[e]^T)      gather fused into GEMM 1
    out[row[a]] += weight[a] * (inner[a] @ down[e]^T)                   weighted scatter-add fused into GEMM 2

with assignments `a` grouped by local expert e (`counts[e]` each). No [A, H] expert output
and no laid-out copy of x ever exist in memory. CUDA tensors run two Triton launches
(each one grouped GEMM over all experts); everything else runs the torch reference with
the same signature.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from .grouped_mm import _default_blocks, _exclusive_cumsum, _input_precision, grouped_mm_reference

__all__ = ["packed_experts", "packed_experts_reference"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATIONS = {"silu": 0, "gelu": 1, "relu": 2}


def _activation(name: str, x: Tensor) -> Tensor:
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "gelu":
        return torch.nn.functional.gelu(x)
    if name == "relu":
        return torch.relu(x)
    raise ValueError(f"unknown activation {name!r}; the fused kernel knows {', '.join(_ACTIVATIONS)}")


def _check(x: Tensor, row: Tensor, weight: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, activation: str) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; the fused kernel knows {', '.join(_ACTIVATIONS)}")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"expected x [V, H], gate_up [L, 2I, H], down [L, H, I]; got {tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    experts, two_i, hidden = gate_up.shape
    if hidden != x.shape[1] or down.shape != (experts, hidden, two_i // 2) or counts.shape != (experts,):
        raise ValueError(f"shapes do not agree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, counts {tuple(counts.shape)}")
    if row.shape != weight.shape or row.dim() != 1:
        raise ValueError(f"row and weight must be [A]; got {tuple(row.shape)}, {tuple(weight.shape)}")


def packed_experts_reference(
    x: Tensor, row: Tensor, weight: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, activation: str
) -> Tensor:
    """out[v] = sum over assignments a of row v: weight[a] * expert_{e(a)}(x[v]); the
    assignments are grouped by expert, counts[e] each."""
    _check(x, row, weight, counts, gate_up, down, activation)
    hidden = grouped_mm_reference(x[row], gate_up, counts)
    gate, up = hidden.chunk(2, dim=-1)
    y = grouped_mm_reference(_activation(activation, gate) * up, down, counts)
    return x.new_zeros(x.shape).index_add_(0, row, y * weight.to(y.dtype).unsqueeze(1))


@triton.jit
def _expert_of_tile(tile_offsets_ptr, pid_m, E, BLOCK_E: tl.constexpr):
    e_idx = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_offsets_ptr + 1 + e_idx, mask=e_idx < E, other=0)
    return tl.sum(((tile_ends <= pid_m) & (e_idx < E)).to(tl.int32), axis=0)


@triton.jit
def _gather_gate_up_kernel(
    x_ptr, row_ptr, w_ptr, inner_ptr,
    offsets_ptr, tile_offsets_ptr,
    I, H, E,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M assignments, BLOCK_N] tile of inner = act(gate) * up for one expert.
    The A operand's rows are gathered from x by row[a]; the gate and up columns of the
    same tile are two accumulators, so the activation is the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _expert_of_tile(tile_offsets_ptr, pid_m, E, BLOCK_E)
    if expert >= E:
        return
    start = tl.load(offsets_ptr + expert) + (pid_m - tl.load(tile_offsets_ptr + expert)) * BLOCK_M
    end = tl.load(offsets_ptr + expert + 1)
    assignments = start + tl.arange(0, BLOCK_M).to(tl.int64)
    a_mask = assignments < end
    rows = tl.load(row_ptr + assignments, mask=a_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < I
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + ks) < H
        a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & c_mask[None, :]
        wg = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(w_base + (I + cols)[None, :] * stride_wn + (k0 + ks)[:, None] * stride_wk, mask=w_mask, other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=INPUT_PRECISION)
        up = tl.dot(a, wu, up, input_precision=INPUT_PRECISION)
    if ACTIVATION == 0:
        act = gate * tl.sigmoid(gate)
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        act = tl.maximum(gate, 0.0)
    out = act * up
    ptrs = inner_ptr + assignments[:, None] * stride_im + cols[None, :] * stride_in
    tl.store(ptrs, out.to(inner_ptr.dtype.element_ty), mask=a_mask[:, None] & c_mask[None, :])


@triton.jit
def _down_scatter_kernel(
    inner_ptr, row_ptr, weight_ptr, w_ptr, out_ptr,
    offsets_ptr, tile_offsets_ptr,
    H, I, E,
    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M assignments, BLOCK_N] tile of inner @ down[e]^T, scaled by each
    assignment's routing weight and added into its token row (atomics: a row's k
    assignments may sit in different experts' tiles)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _expert_of_tile(tile_offsets_ptr, pid_m, E, BLOCK_E)
    if expert >= E:
        return
    start = tl.load(offsets_ptr + expert) + (pid_m - tl.load(tile_offsets_ptr + expert)) * BLOCK_M
    end = tl.load(offsets_ptr + expert + 1)
    assignments = start + tl.arange(0, BLOCK_M).to(tl.int64)
    a_mask = assignments < end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < H
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = (k0 + ks) < I
        a = tl.load(inner_ptr + assignments[:, None] * stride_im + (k0 + ks)[None, :] * stride_ik, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None] * stride_wk, mask=k_mask[:, None] & c_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    rows = tl.load(row_ptr + assignments, mask=a_mask, other=0).to(tl.int64)
    scale = tl.load(weight_ptr + assignments, mask=a_mask, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.atomic_add(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc, mask=a_mask[:, None] & c_mask[None, :])


def _packed_experts_triton(
    x: Tensor, row: Tensor, weight: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, activation: str,
    *, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
) -> Tensor:
    _check(x, row, weight, counts, gate_up, down, activation)
    experts, two_i, hidden = gate_up.shape
    inner_width, assignments = two_i // 2, row.numel()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # fp32 accumulator for the atomics
    if assignments == 0 or hidden == 0:
        return out.to(x.dtype)
    bm, bn, bk = _default_blocks(x.dtype)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    counts = counts.to(device=x.device, dtype=torch.int64)
    offsets = _exclusive_cumsum(counts)
    tile_offsets = _exclusive_cumsum((counts + bm - 1) // bm)
    inner = x.new_empty((assignments, inner_width))
    row, weight = row.contiguous(), weight.contiguous()
    tiles = triton.cdiv(assignments, bm) + experts
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(experts), INPUT_PRECISION=_input_precision(x.dtype))
    _gather_gate_up_kernel[(tiles, triton.cdiv(inner_width, bn))](
        x, row, gate_up, inner, offsets, tile_offsets,
        inner_width, hidden, experts,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), inner.stride(0), inner.stride(1),
        ACTIVATION=_ACTIVATIONS[activation], **common,
    )
    _down_scatter_kernel[(tiles, triton.cdiv(hidden, bn))](
        inner, row, weight, down, out, offsets, tile_offsets,
        hidden, inner_width, experts,
        inner.stride(0), inner.stride(1), down.stride(0), down.stride(1), down.stride(2), out.stride(0), out.stride(1),
        **common,
    )
    return out.to(x.dtype)


def packed_experts(x: Tensor, row: Tensor, weight: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, activation: str) -> Tensor:
    """The fused packed-expert computation (see the module docstring). CUDA fp16/bf16/fp32
    -> Triton; everything else -> `packed_experts_reference`."""
    if x.is_cuda and x.dtype in _TRITON_DTYPES:
        return _packed_experts_triton(x, row, weight, counts, gate_up, down, activation)
    return packed_experts_reference(x, row, weight, counts, gate_up, down, activation)
