"""Kernels of PowerSGD compression (Vogels et al., NeurIPS 2019; Optimus-CC's backward codec).

orthogonalize(p)          -> p with orthonormal columns (Gram-Schmidt, each column twice)
lowrank_residual(m, p, q) -> m - p @ q.T   (the error-feedback residual, one pass over m)

Gram-Schmidt is applied twice per column ("twice is enough", Giraud et al. 2005): one pass
leaves rounding errors along the earlier columns, which matter when P is rank deficient
(a gradient of rank below r). A column whose norm falls below `tol` times its norm before
orthogonalisation is set to zero: it carried no new direction, and a zero column keeps
P Pᵀ an exact projection, so a gradient of rank <= r is rebuilt exactly.

The orthogonalisation kernel is one program that walks the columns (r is small: 1-64);
the residual kernel tiles m and subtracts the r outer products in registers, so the
residual costs one read and one write of m instead of materialising p @ q.T.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

__all__ = ["lowrank_residual", "lowrank_residual_reference", "orthogonalize", "orthogonalize_reference"]

_KERNEL_DTYPES = (torch.float32, torch.float64)


def default_tol(dtype: torch.dtype) -> float:
    return 1000.0 * torch.finfo(dtype).eps


# --------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------

def orthogonalize_reference(p: Tensor, tol: float | None = None) -> Tensor:
    tol = default_tol(p.dtype) if tol is None else tol
    out = p.clone()
    for j in range(out.shape[1]):
        v = out[:, j].clone()
        before = v.norm()
        for _ in range(2):
            if j:
                v -= out[:, :j] @ (out[:, :j].T @ v)
        norm = v.norm()
        out[:, j] = v / norm if norm > tol * before and norm > 0 else torch.zeros_like(v)
    return out


def lowrank_residual_reference(m: Tensor, p: Tensor, q: Tensor) -> Tensor:
    return m - p @ q.T


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------

@triton.jit
def _column_dot(p_ptr, a, b, n, stride_n, stride_r, BLOCK_N: tl.constexpr):
    acc = tl.zeros([BLOCK_N], dtype=p_ptr.dtype.element_ty)
    for start in range(0, n, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        mask = rows < n
        x = tl.load(p_ptr + rows * stride_n + a * stride_r, mask=mask, other=0.0)
        y = tl.load(p_ptr + rows * stride_n + b * stride_r, mask=mask, other=0.0)
        acc += x * y
    return tl.sum(acc, axis=0)


@triton.jit
def _orthogonalize_kernel(p_ptr, n, stride_n, stride_r, tol, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: columns in order, each made orthogonal to the earlier ones twice, then
    normalised (or zeroed when nothing new is left)."""
    for j in range(R):
        before = tl.sqrt(_column_dot(p_ptr, j, j, n, stride_n, stride_r, BLOCK_N))
        for _ in range(2):
            for k in range(j):
                dot = _column_dot(p_ptr, k, j, n, stride_n, stride_r, BLOCK_N)
                for start in range(0, n, BLOCK_N):
                    rows = start + tl.arange(0, BLOCK_N)
                    mask = rows < n
                    pk = tl.load(p_ptr + rows * stride_n + k * stride_r, mask=mask, other=0.0)
                    pj = tl.load(p_ptr + rows * stride_n + j * stride_r, mask=mask, other=0.0)
                    tl.store(p_ptr + rows * stride_n + j * stride_r, pj - dot * pk, mask=mask)
                tl.debug_barrier()
        norm = tl.sqrt(_column_dot(p_ptr, j, j, n, stride_n, stride_r, BLOCK_N))
        keep = (norm > tol * before) & (norm > 0)
        scale = tl.where(keep, 1.0 / tl.where(keep, norm, 1.0), 0.0)
        for start in range(0, n, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            mask = rows < n
            pj = tl.load(p_ptr + rows * stride_n + j * stride_r, mask=mask, other=0.0)
            tl.store(p_ptr + rows * stride_n + j * stride_r, pj * scale, mask=mask)
        tl.debug_barrier()


@triton.jit
def _lowrank_residual_kernel(
    m_ptr, p_ptr, q_ptr, out_ptr, n, cols,
    stride_mn, stride_pn, stride_qn, stride_on,
    R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cs = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows[:, None] < n) & (cs[None, :] < cols)
    acc = tl.load(m_ptr + rows[:, None] * stride_mn + cs[None, :], mask=mask, other=0.0)
    for k in range(R):
        pk = tl.load(p_ptr + rows * stride_pn + k, mask=rows < n, other=0.0)
        qk = tl.load(q_ptr + cs * stride_qn + k, mask=cs < cols, other=0.0)
        acc -= pk[:, None] * qk[None, :]
    tl.store(out_ptr + rows[:, None] * stride_on + cs[None, :], acc, mask=mask)


# --------------------------------------------------------------------------
# launchers and dispatch (CUDA -> Triton, otherwise the reference)
# --------------------------------------------------------------------------

def _orthogonalize_triton(p: Tensor, tol: float | None = None, block_n: int | None = None) -> Tensor:
    out = p.contiguous().clone()
    tol = default_tol(p.dtype) if tol is None else tol
    block = block_n or min(1024, triton.next_power_of_2(max(out.shape[0], 16)))
    _orthogonalize_kernel[(1,)](out, out.shape[0], out.stride(0), out.stride(1), tol, R=out.shape[1], BLOCK_N=block)
    return out


def _lowrank_residual_triton(m: Tensor, p: Tensor, q: Tensor, block_n: int = 32, block_m: int = 32) -> Tensor:
    m, p, q = m.contiguous(), p.contiguous(), q.contiguous()
    out = torch.empty_like(m)
    grid = (triton.cdiv(m.shape[0], block_n), triton.cdiv(m.shape[1], block_m))
    _lowrank_residual_kernel[grid](
        m, p, q, out, m.shape[0], m.shape[1], m.stride(0), p.stride(0), q.stride(0), out.stride(0),
        R=p.shape[1], BLOCK_N=block_n, BLOCK_M=block_m,
    )
    return out


def orthogonalize(p: Tensor, tol: float | None = None) -> Tensor:
    """P [n, r] with orthonormal (or zero) columns; see the module doc."""
    if p.dim() != 2:
        raise ValueError(f"orthogonalize takes a 2-d [n, r] matrix, got shape {tuple(p.shape)}")
    if p.is_cuda and p.dtype in _KERNEL_DTYPES:
        return _orthogonalize_triton(p, tol)
    return orthogonalize_reference(p, tol)


def lowrank_residual(m: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """m - p @ q.T for m [n, c], p [n, r], q [c, r]."""
    if m.dim() != 2 or p.shape != (m.shape[0], p.shape[1]) or q.shape != (m.shape[1], p.shape[1]):
        raise ValueError(f"lowrank_residual needs m [n, c], p [n, r], q [c, r]; got {tuple(m.shape)}, {tuple(p.shape)}, {tuple(q.shape)}")
    if m.is_cuda and m.dtype in _KERNEL_DTYPES:
        return _lowrank_residual_triton(m, p, q)
    return lowrank_residual_reference(m, p, q)
