"""Canonical MoE ops: router, dispatch, expert FFN, row regrouping and combine.

After `lift`, every MoE block of every model family is spelled with these ops, so the
later passes (expert parallelism, partitioning, packing) see one vocabulary. Each op is a
`torch.library.custom_op` with a fake implementation (so graphs can be traced with fake
tensors and lowered with aot_autograd) and an explicit backward.

Layout conventions, shared by every op here:
- an *assignment* is one (token, choice) pair; assignment a = token * k + choice;
- dispatch lays assignments out in *rows* grouped by expert (expert 0's rows first);
  `slot[a]` is the row of assignment a, or -1 where capacity dropped it;
- counts are int64 tensors; counts[e] rows belong to expert e.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .autocast import register_autocast
from .grouped_gemm import grouped_mm, grouped_mm_weight_grad

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
    return cdf + x * torch.exp(-0.5 * x * x) * 0.3989422804014327


# Derivatives written out: custom-op bodies run below autograd, so no autograd.grad there.
ACTIVATION_GRADS = {"silu": _silu_grad, "gelu": _gelu_grad, "relu": lambda x: (x > 0).to(x.dtype)}


# ---------------------------------------------------------------------------- router


@torch.library.custom_op("commfx::topk_router", mutates_args=())
def topk_router(
    logits: torch.Tensor, k: int, normalize: bool, score_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(logits) in `score_dtype`, top-k, optionally renormalised: (weights [N,k], indices [N,k])."""
    probs = torch.softmax(logits.to(score_dtype), dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


@topk_router.register_fake
def _(logits, k, normalize, score_dtype):
    shape = (logits.shape[0], k)
    return logits.new_empty(shape, dtype=score_dtype), logits.new_empty(shape, dtype=torch.int64)


def _topk_router_setup(ctx, inputs, output):
    logits, k, normalize, score_dtype = inputs
    weights, indices = output
    ctx.save_for_backward(logits, indices)
    ctx.normalize, ctx.score_dtype = normalize, score_dtype


def _topk_router_backward(ctx, grad_weights, grad_indices):
    # The same op sequence autograd runs for softmax -> topk -> (v / v.sum()), so the
    # gradient is bit-identical to the unlifted router even when it runs in float32.
    logits, indices = ctx.saved_tensors
    probs = torch.softmax(logits.to(ctx.score_dtype), dim=-1)
    picked = probs.gather(-1, indices)
    grad_picked = grad_weights
    if ctx.normalize:
        total = picked.sum(-1, keepdim=True)
        grad_total = (-grad_weights * ((picked / total) / total)).sum(-1, keepdim=True)
        grad_picked = grad_weights / total + grad_total
    grad_probs = torch.zeros_like(probs).scatter_(-1, indices, grad_picked)
    grad_logits = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    return grad_logits.to(logits.dtype), None, None, None


topk_router.register_autograd(_topk_router_backward, setup_context=_topk_router_setup)


# ---------------------------------------------------------------------------- dispatch


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert in capacity mode: ceil(factor * tokens * k / experts), at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))


@torch.library.custom_op("commfx::moe_dispatch", mutates_args=())
def moe_dispatch(
    x: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    capacity_floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay tokens out by expert: (rows [R,H], counts [E], slot [N*k]).

    capacity_factor <= 0 is dropless: R = N*k. Otherwise every expert gets exactly
    C = expert_capacity(...) rows (R = E*C, zero rows pad); assignments past an expert's
    capacity are dropped in token order (earlier tokens keep their place), contribute
    nothing to the output and the token's other weights are not renormalised: the
    residual connection carries a dropped token. `capacity_floor` (a scalar tensor measured
    from the batch, e.g. LocMoE's bound) raises the factor in capacity mode: the factor used
    is max(capacity_factor, capacity_floor); dropless mode ignores it.
    """
    factor = effective_capacity_factor(capacity_factor, capacity_floor)
    row_token, counts, slot = _dispatch_layout(indices, num_experts, factor)
    if not x.shape[0]:
        return x.new_zeros((row_token.shape[0], x.shape[1])), counts, slot
    rows = x.index_select(0, row_token.clamp(min=0))
    if factor > 0:  # capacity mode: padding rows (row_token -1) are zeros
        rows.masked_fill_((row_token < 0).unsqueeze(1), 0)
    return rows, counts, slot


def effective_capacity_factor(capacity_factor: float, capacity_floor: torch.Tensor | None) -> float:
    """max(configured factor, measured floor) in capacity mode; dropless (<= 0) stays dropless."""
    if capacity_factor <= 0 or capacity_floor is None:
        return capacity_factor
    return max(capacity_factor, float(capacity_floor))


def _dispatch_layout(indices: torch.Tensor, num_experts: int, capacity_factor: float):
    """(row_token [R] (-1 on padding), counts [E], slot [N*k]) for a dispatch. No host sync:
    R is known on the host (N*k, or E*capacity), and nothing is indexed by a boolean mask."""
    n, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments by expert, token order within one
    counts = expert_counts(flat, num_experts)
    if capacity_factor <= 0:
        slot = torch.empty_like(order).scatter(0, order, torch.arange(order.numel(), device=order.device))
        return order // k, counts, slot
    capacity = expert_capacity(n, k, num_experts, capacity_factor)
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    position = torch.arange(order.numel(), device=order.device) - starts[sorted_experts]
    keep = position < capacity
    rows = num_experts * capacity
    destination = torch.where(keep, sorted_experts * capacity + position, rows)  # dropped: a spare row past the end
    slot = torch.empty_like(flat)
    slot[order] = torch.where(keep, destination, -1)
    row_token = torch.full((rows + 1,), -1, dtype=torch.int64, device=indices.device)
    row_token[destination] = torch.where(keep, order // k, -1)
    return row_token[:rows], torch.full_like(counts, capacity), slot


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, [E] int64: bincount without its host sync (on CUDA bincount
    reads the largest index to size its output; here the size is known)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add(0, flat, torch.ones_like(flat, dtype=torch.int64))


@moe_dispatch.register_fake
def _(x, indices, num_experts, capacity_factor, capacity_floor=None):
    n, k = indices.shape
    rows = n * k if capacity_factor <= 0 else torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty((rows, x.shape[1])),
        indices.new_empty((num_experts,), dtype=torch.int64),
        indices.new_empty((n * k,), dtype=torch.int64),
    )


def _dispatch_setup(ctx, inputs, output):
    x, indices = inputs[:2]
    ctx.save_for_backward(output[2])
    ctx.num_tokens, ctx.k = x.shape[0], indices.shape[1]


def _dispatch_backward(ctx, grad_rows, grad_counts, grad_slot):
    (slot,) = ctx.saved_tensors
    return moe_scatter_rows(grad_rows, slot, ctx.num_tokens, ctx.k), None, None, None, None


moe_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
# The rows the experts multiply, cast before they are laid out (and sent): half the bytes.
register_autocast(torch.ops.commfx.moe_dispatch.default, (0,))


@torch.library.custom_op("commfx::moe_scatter_rows", mutates_args=())
def moe_scatter_rows(rows: torch.Tensor, slot: torch.Tensor, num_tokens: int, k: int) -> torch.Tensor:
    """The adjoint of dispatch: out[t] = sum of rows[slot[a]] over t's kept assignments a.
    Dropped assignments (slot -1) add into a spare token past the end (no mask indexing)."""
    out = rows.new_zeros((num_tokens + 1, rows.shape[1]))
    if rows.shape[0]:
        tokens = torch.where(slot >= 0, torch.arange(slot.numel(), device=slot.device) // k, num_tokens)
        out.index_add_(0, tokens, rows.index_select(0, slot.clamp(min=0)))
    return out[:num_tokens]


@moe_scatter_rows.register_fake
def _(rows, slot, num_tokens, k):
    return rows.new_empty((num_tokens, rows.shape[1]))


# ---------------------------------------------------------------------------- combine


@torch.library.custom_op("commfx::moe_combine", mutates_args=())
def moe_combine(rows: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * rows[slot[t*k + j]] (a dropped assignment adds nothing)."""
    n, k = weights.shape
    picked = _gather_assignments(rows, slot)
    # Explicit widths, not -1: a rank may receive no rows at all (n == 0).
    return (picked.view(n, k, rows.shape[1]) * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)


def _gather_assignments(rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    picked = rows[slot.clamp(min=0)]
    return picked * (slot >= 0).unsqueeze(-1).to(rows.dtype)


@moe_combine.register_fake
def _(rows, slot, weights):
    return rows.new_empty((weights.shape[0], rows.shape[1]))


def _combine_setup(ctx, inputs, output):
    rows, slot, weights = inputs
    ctx.save_for_backward(rows, slot, weights)


def _combine_backward(ctx, grad_out):
    rows, slot, weights = ctx.saved_tensors
    grad_rows, grad_weights = moe_combine_backward(grad_out, rows, slot, weights)
    return grad_rows, None, grad_weights


@torch.library.custom_op("commfx::moe_combine_backward", mutates_args=())
def moe_combine_backward(
    grad_out: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of moe_combine with respect to its rows and its routing weights."""
    n, k = weights.shape
    grad_assign = (grad_out.unsqueeze(1) * weights.to(rows.dtype).unsqueeze(-1)).reshape(n * k, rows.shape[1])
    spare = rows.new_zeros((rows.shape[0] + 1, rows.shape[1]))  # dropped assignments land in a spare row
    grad_rows = spare.index_put((torch.where(slot >= 0, slot, rows.shape[0]),), grad_assign)[: rows.shape[0]]
    picked = _gather_assignments(rows, slot).view(n, k, rows.shape[1])
    grad_weights = (picked * grad_out.unsqueeze(1)).sum(-1).to(weights.dtype)
    return grad_rows, grad_weights


@moe_combine_backward.register_fake
def _(grad_out, rows, slot, weights):
    return torch.empty_like(rows), torch.empty_like(weights)


moe_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---------------------------------------------------------------------------- experts


@torch.library.custom_op("commfx::expert_ffn", mutates_args=())
def expert_ffn(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str
) -> torch.Tensor:
    """Gated expert FFN over rows grouped by expert: down_e(act(gate_e x) * up_e x).

    gate_up is [E, 2I, H] (gate rows first), down is [E, H, I], both F.linear layout; E is
    the number of experts this op holds, so after expert parallelism it is the local shard.
    """
    gate_up, down = in_rows_dtype(x, gate_up, down)
    hidden = grouped_mm(x, gate_up, counts)
    gate, up = hidden.chunk(2, dim=-1)
    return grouped_mm(ACTIVATIONS[activation](gate) * up, down, counts)


def in_rows_dtype(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The experts' weights in the rows' dtype, as autocast casts a linear's weight: under
    mixed precision (Plan.precision) the parameters are float32 masters and the rows
    bfloat16. No copy when they agree; the weights' gradients are cast back by the caller."""
    return tuple(w if w.dtype == x.dtype else w.to(x.dtype) for w in weights)


@expert_ffn.register_fake
def _(x, counts, gate_up, down, activation):
    return x.new_empty((x.shape[0], down.shape[1]))


def _expert_ffn_setup(ctx, inputs, output):
    x, counts, gate_up, down, activation = inputs
    ctx.save_for_backward(x, counts, gate_up, down)
    ctx.activation = activation


def _expert_ffn_backward(ctx, grad_out):
    x, counts, gate_up, down = ctx.saved_tensors
    grad_x, grad_gate_up, grad_down = expert_ffn_backward(grad_out, x, counts, gate_up, down, ctx.activation)
    return grad_x, None, grad_gate_up, grad_down, None


@torch.library.custom_op("commfx::expert_ffn_backward", mutates_args=())
def expert_ffn_backward(
    grad_out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of expert_ffn for x, gate_up and down (the hidden layer is recomputed)."""
    masters = gate_up, down
    gate_up, down = in_rows_dtype(x, gate_up, down)
    hidden = grouped_mm(x, gate_up, counts)  # recomputed: cheaper in memory than saving it
    grad_x, grad_gate_up, grad_down = expert_ffn_backward_from_hidden(grad_out, x, hidden, counts, gate_up, down, activation)
    return grad_x, grad_gate_up.to(masters[0].dtype), grad_down.to(masters[1].dtype)


def expert_ffn_backward_from_hidden(
    grad_out: torch.Tensor, x: torch.Tensor, hidden: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ffn_backward given the hidden layer x @ gate_up, for a caller that has it
    already (pack_experts' backward recomputes it once for the outputs and the gradients)."""
    grad_x, grad_gate_up, grad_down, _ = weighted_expert_ffn_backward(grad_out, None, x, hidden, counts, gate_up, down, activation)
    return grad_x, grad_gate_up, grad_down


def weighted_expert_ffn_backward(
    grad_out: torch.Tensor, row_weights: torch.Tensor | None, x: torch.Tensor, hidden: torch.Tensor, counts: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of rows_out = row_weights * expert_ffn(x) given the hidden layer, with
    `grad_out` the gradient of rows_out. The routing weights' gradient is
    grad_out . expert_ffn(x) = (grad_out @ down) . (act(gate) * up): the product grad_out @ down
    the experts' own backward needs anyway, so the expert outputs are never recomputed (one
    grouped GEMM fewer than recomputing them). `row_weights=None` means weights of one."""
    gate, up = hidden.chunk(2, dim=-1)
    activated = ACTIVATIONS[activation](gate)
    inner = activated * up
    grad_inner = grouped_mm(grad_out, down, counts, trans_w=False)
    grad_row_weights = None
    if row_weights is not None:
        scale = row_weights.to(grad_out.dtype).unsqueeze(-1)
        grad_row_weights = (grad_inner * inner).sum(-1).to(row_weights.dtype)
        grad_out, grad_inner = grad_out * scale, grad_inner * scale
    grad_down = grouped_mm_weight_grad(grad_out, inner, counts)
    grad_gate = grad_inner * up * ACTIVATION_GRADS[activation](gate)
    grad_hidden = torch.cat([grad_gate, grad_inner * activated], dim=-1)
    grad_gate_up = grouped_mm_weight_grad(grad_hidden, x, counts)
    grad_x = grouped_mm(grad_hidden, gate_up, counts, trans_w=False)
    return grad_x, grad_gate_up, grad_down, grad_row_weights


@expert_ffn_backward.register_fake
def _(grad_out, x, counts, gate_up, down, activation):
    return torch.empty_like(x), torch.empty_like(gate_up), torch.empty_like(down)


expert_ffn.register_autograd(_expert_ffn_backward, setup_context=_expert_ffn_setup)
register_autocast(torch.ops.commfx.expert_ffn.default, (0, 2, 3))  # rows and both weights


# ---------------------------------------------------------------------------- regrouping


@torch.library.custom_op("commfx::group_by_expert", mutates_args=())
def group_by_expert(rows: torch.Tensor, counts: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Reorder rows between source-major and expert-major order.

    After the dispatch all-to-all a rank holds, for each source rank s, counts[s, e] rows
    for each of its local experts e (source-major). The experts want expert-major order.
    `inverse=True` goes back (before the combine all-to-all).
    """
    out = regroup(rows, counts, inverse)
    return out.clone() if out is rows else out  # an op's output may not alias its input


def regroup(rows: torch.Tensor, counts: torch.Tensor, inverse: bool) -> torch.Tensor:
    """group_by_expert's computation, out of place; `rows` itself from one source, where
    source-major already is expert-major."""
    if counts.shape[0] == 1:
        return rows
    order = _source_to_expert_order(counts, rows.shape[0])
    return torch.empty_like(rows).index_copy(0, order, rows) if inverse else rows.index_select(0, order)


def _source_to_expert_order(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Indices into source-major rows that list them expert-major; `total` = counts.sum(),
    which the host knows already (the rows' length), so it is not read back."""
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) run begins, source-major
    by_expert = counts.t().reshape(-1)  # the same runs, expert-major
    begins = starts.view(counts.shape).t().reshape(-1)
    placed = torch.cumsum(by_expert, 0) - by_expert  # where each run lands, expert-major
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(begins - placed, by_expert, output_size=total)


@group_by_expert.register_fake
def _(rows, counts, inverse):
    return torch.empty_like(rows)


def _group_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.inverse = inputs[2]


def _group_backward(ctx, grad):
    (counts,) = ctx.saved_tensors
    return group_by_expert(grad, counts, not ctx.inverse), None, None


group_by_expert.register_autograd(_group_backward, setup_context=_group_setup)
