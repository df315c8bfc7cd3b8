"""Low-precision dispatch (DeepEP's recipe): token rows cross the wire as float8 e4m3 bytes.

The sender cuts each row's first `H - exact_cols` values into blocks of 128 (the last block
may be shorter), scales every block by its own amax / 448 (448: e4m3's largest finite value)
and rounds to e4m3; the wire carries, per row, the H' fp8 bytes, one float32 scale per
block, then the row's last `exact_cols` values bit for bit (routing metadata that
pack_experts carries as columns, given as `meta`). The receiver multiplies back and returns rows in the
sender's dtype, before the experts. Gloo has no float8, so the payload is uint8.

    fp8_encode (rows -> uint8 payload) -> all_to_all (bytes) -> fp8_decode (payload -> rows)

The backward is straight-through, as DeepEP's: the gradient of the dequantised rows goes
back through the reverse all-to-all in the rows' own dtype (bf16) to the rows that were
quantised, as if the exchange were exact.

Error bound (per value x of a block whose largest magnitude is amax, s = amax / 448): e4m3
keeps 4 significant bits, so rounding a normal value x/s costs at most 2^-4 of it, a
subnormal one (|x/s| < 2^-6) at most half its step 2^-9, i.e. 2^-10·s; the product q·s is
exact in float32 and its rounding to bf16 adds at most 2^-8 of it:

    |decode(encode(x)) - x| <= (2^-4 + 2^-7)·|x| + 2^-10·s        (so <= 0.071·amax)

Bytes: a bf16 row of H values is 2H bytes; its fp8 form H + 4·ceil(H/128) (0.516x at
H = 128), plus the exact columns' bytes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .comm import all_to_all

BLOCK = 128  # values per scale
E4M3_MAX = 448.0  # the largest finite float8 e4m3 (fn) value
_TINY = 1e-12  # an all-zero block keeps a positive scale (its values decode to zero)


def blocks(width: int) -> int:
    """Scale blocks of a row of `width` quantised values."""
    return math.ceil(width / BLOCK) if width else 0


def exact_columns(dtype: torch.dtype, meta: Optional[torch.Tensor]) -> int:
    """Trailing columns of `dtype` that hold `meta`'s values bit for bit (attach_meta's layout)."""
    return 0 if meta is None else -(-meta.shape[1] * meta.dtype.itemsize // dtype.itemsize)


def payload_width(hidden: int, exact_cols: int, dtype: torch.dtype) -> int:
    """Bytes per row on the wire for rows of `hidden` values of `dtype`, the last `exact_cols` exact."""
    quantised = hidden - exact_cols
    return quantised + 4 * blocks(quantised) + exact_cols * dtype.itemsize


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [R, W] -> (e4m3 values as uint8 [R, W], float32 scales [R, ceil(W/128)])."""
    rows, width = x.shape
    n = blocks(width)
    padded = torch.nn.functional.pad(x.float(), (0, n * BLOCK - width)).view(rows, n, BLOCK)
    scales = (padded.abs().amax(dim=2) / E4M3_MAX).clamp_min(_TINY)
    q = (padded / scales.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(rows, n * BLOCK)[:, :width], scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize` (up to its rounding), in `dtype`."""
    rows, width = q.shape
    n = scales.shape[1]
    padded = torch.nn.functional.pad(q, (0, n * BLOCK - width)).view(torch.float8_e4m3fn).float().view(rows, n, BLOCK)
    return (padded * scales.unsqueeze(2)).view(rows, n * BLOCK)[:, :width].to(dtype)


def encode(x: torch.Tensor, exact_cols: int = 0) -> torch.Tensor:
    """Rows [R, H] -> the wire's uint8 payload [R, payload_width] (see module doc)."""
    quantised = x.shape[1] - exact_cols
    q, scales = quantize(x[:, :quantised])
    exact = x[:, quantised:].contiguous().view(torch.uint8)
    return torch.cat([q, scales.view(torch.uint8).view(x.shape[0], -1), exact], dim=1)


def decode(payload: torch.Tensor, hidden: int, exact_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The receiver's side of `encode`: payload [R, W] -> rows [R, hidden] of `dtype`."""
    quantised = hidden - exact_cols
    n = blocks(quantised)
    q = payload[:, :quantised]
    scales = payload[:, quantised : quantised + 4 * n].clone(memory_format=torch.contiguous_format).view(torch.float32)  # a fresh, aligned buffer
    rows = dequantize(q, scales, dtype)
    if not exact_cols:
        return rows
    exact = payload[:, quantised + 4 * n :].clone(memory_format=torch.contiguous_format).view(dtype)
    return torch.cat([rows, exact], dim=1)


@torch.library.custom_op("commfx::fp8_encode", mutates_args=())
def fp8_encode(x: torch.Tensor, meta: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows [R, H] -> uint8 payload: e4m3 values and a float32 scale per 128; with `meta`
    (routing metadata attach_meta put in x's last columns) those columns kept exact."""
    return encode(x, exact_columns(x.dtype, meta))


@fp8_encode.register_fake
def _(x, meta=None):
    width = payload_width(x.shape[1], exact_columns(x.dtype, meta), x.dtype)
    return x.new_empty((x.shape[0], width), dtype=torch.uint8)


@torch.library.custom_op("commfx::fp8_decode", mutates_args=())
def fp8_decode(
    payload: torch.Tensor, rows: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
    group: str, priority: str = "a2a", tag: str = "", meta: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The received payload [R', W] -> rows [R', H] in `rows`' dtype (rows: what this rank
    encoded and sent; only its width and dtype are read, and its gradient is returned
    straight through, by the reverse all-to-all of `send_counts`/`recv_counts` on `group`)."""
    return decode(payload, rows.shape[1], exact_columns(rows.dtype, meta), rows.dtype)


@fp8_decode.register_fake
def _(payload, rows, send_counts, recv_counts, group, priority="a2a", tag="", meta=None):
    return rows.new_empty((payload.shape[0], rows.shape[1]))


def _decode_setup(ctx, inputs, output):
    _, _, send_counts, recv_counts, group, priority, tag, _ = inputs
    ctx.save_for_backward(send_counts, recv_counts)
    ctx.group, ctx.priority, ctx.tag = group, priority, tag


def _decode_backward(ctx, grad):
    send_counts, recv_counts = ctx.saved_tensors
    tag = f"{ctx.tag} (bw)" if ctx.tag else ""
    back = all_to_all(grad.contiguous(), recv_counts, send_counts, ctx.group, ctx.priority, tag)
    return None, back, None, None, None, None, None, None


fp8_decode.register_autograd(_decode_backward, setup_context=_decode_setup)
