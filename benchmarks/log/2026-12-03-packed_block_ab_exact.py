import torch
from commfx.ops import moe
from commfx.ops.grouped_gemm import grouped_mm

def _exact_layout(local_ids, local_experts):
    flat = local_ids.reshape(-1)
    valid = flat >= 0
    expert = torch.where(valid, flat, local_experts)
    order = torch.argsort(expert, stable=True)
    counts = moe.expert_counts(expert, local_experts + 1)[:local_experts]
    a = counts.sum().item()
    torch._check_is_size(a); torch._check(a <= flat.numel())
    slot = torch.empty_like(order).scatter(0, order, torch.arange(order.numel(), device=order.device))
    slot = torch.where(valid, slot + 1, 0).view_as(local_ids)  # invalid -> the zero row put first
    return order[:a], counts, slot

def _gather(rows, slot):
    return torch.cat([rows.new_zeros((1,) + rows.shape[1:]), rows])[slot]

def packed_ffn(x, local_ids, weights, gate_up, down, activation):
    k = local_ids.shape[1]
    order, counts, slot = _exact_layout(local_ids, gate_up.shape[0])
    gate_up, down = moe.in_rows_dtype(x, gate_up, down)
    gate, up = grouped_mm(x.index_select(0, order // k), gate_up, counts).chunk(2, dim=-1)
    y = grouped_mm(moe.ACTIVATIONS[activation](gate) * up, down, counts)
    return (_gather(y, slot) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)

def packed_ffn_backward(grad_out, x, local_ids, weights, gate_up, down, activation):
    k = local_ids.shape[1]
    order, counts, slot = _exact_layout(local_ids, gate_up.shape[0])
    row = order // k
    laid = x.index_select(0, row)
    masters = gate_up, down
    gate_up, down = moe.in_rows_dtype(x, gate_up, down)
    hidden = grouped_mm(laid, gate_up, counts)
    grad_laid, grad_gate_up, grad_down, grad_laid_weights = moe.weighted_expert_ffn_backward(
        grad_out.index_select(0, row), weights.reshape(-1)[order], laid, hidden, counts, gate_up, down, activation)
    return _gather(grad_laid, slot).sum(dim=1), _gather(grad_laid_weights, slot), grad_gate_up.to(masters[0].dtype), grad_down.to(masters[1].dtype)
