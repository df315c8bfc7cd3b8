"""How far a mixed-precision run may be from the same recipe in one process (commfx verify)."""

from __future__ import annotations

import torch

MIXED_PRECISION_FORMULA = "((R + 1) x eps(bf16) + n x eps(fp32)) x max|reference|"


def mixed_precision_tolerance(reference: torch.Tensor, ranks: int, tokens: int, precision: str = "bf16") -> float:
    """The tolerance of one tensor of a mixed-precision run against the same recipe in one process.

    Both runs round the same per-token values the same way; what differs is how reductions
    over tokens are split. The distributed run sums a reduction (a weight gradient over the
    tokens) as R partial products, one per data-parallel rank (and per tensor-parallel rank: a
    parameter every tp rank uses, a norm's inside a split block, sums tp partials too), each rounded once to bf16, and
    adds them in fp32; the reference rounds the whole sum once. Each rounding is within
    eps(bf16)/2 of its value, so R + 1 roundings differ by at most (R + 1) x eps/2 of the
    largest partial; the fp32 accumulation of a reduction of length n (the global tokens, the
    longest reduction: a weight gradient's) adds at most n x eps(fp32). Relative to the
    reference's largest entry, with a margin of 2 for partials larger than their sum:
    ((R + 1) x eps(bf16) + n x eps(fp32)) x max|reference|."""
    from .compiler.precision import precision_dtype

    scale = reference.abs().max().item() if reference.numel() else 0.0
    eps_low, eps_fp32 = torch.finfo(precision_dtype(precision)).eps, torch.finfo(torch.float32).eps
    return ((ranks + 1) * eps_low + tokens * eps_fp32) * scale
