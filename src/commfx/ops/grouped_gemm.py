"""Grouped GEMMs as ops: the experts' matrix products, opaque to the compiler.

`expert_ffn` and its backward are written with these two ops, so when Inductor compiles a
region holding the experts (`ops/decompositions.py` opens the expert ops into them) the
GEMMs stay the kernels of `kernels/grouped_mm.py` (cuBLAS grouped GEMM, Triton, or the
per-expert reference on the CPU) and everything between them (activation, gating product,
casts, their gradients) is fused around them. Rows are grouped by expert per `counts`.

Rows past sum(counts) are padding: they belong to no expert, add nothing to a weight
gradient, and their output rows are unspecified (zeros from the torch reference; the CUDA
kernels leave them unwritten). So a caller with a data-dependent number of rows can keep
a static shape (e.g. the packed experts' decomposition: [V*k] assignments, the invalid ones
last) without a host sync and without multiplying the padding; it must mask what the
padding rows produce (`torch.where`, not a product: an unwritten row may hold NaN).
"""

from __future__ import annotations

import torch

from ..kernels import grouped_mm as _grouped_mm
from ..kernels import grouped_mm_weight_grad as _grouped_mm_weight_grad


@torch.library.custom_op("commfx::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, trans_w: bool = True) -> torch.Tensor:
    """[T, K] rows times their expert's weights: w [E, N, K] (x_e @ w[e].T) if trans_w, else [E, K, N]."""
    return _grouped_mm(x, w, counts, trans_w=trans_w, padded=True)


@grouped_mm.register_fake
def _(x, w, counts, trans_w=True):
    return x.new_empty((x.shape[0], w.shape[1] if trans_w else w.shape[2]))


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts, trans_w = inputs
    ctx.save_for_backward(x, w, counts)
    ctx.trans_w = trans_w


def _grouped_mm_backward(ctx, grad_out):
    x, w, counts = ctx.saved_tensors
    grad_x = grouped_mm(grad_out, w, counts, not ctx.trans_w)
    grad_w = grouped_mm_weight_grad(grad_out, x, counts) if ctx.trans_w else grouped_mm_weight_grad(x, grad_out, counts)
    return grad_x, grad_w, None, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.library.custom_op("commfx::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[E, N, K] with [e] = grad_out_e.T @ x_e: the weights' gradient of grouped_mm(trans_w=True)."""
    return _grouped_mm_weight_grad(grad_out, x, counts, padded=True)


@grouped_mm_weight_grad.register_fake
def _(grad_out, x, counts):
    return x.new_empty((counts.shape[0], grad_out.shape[1], x.shape[1]))
