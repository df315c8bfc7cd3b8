"""The experts' weight gradient is column-major per expert on CUDA (cuBLAS's grouped GEMM is
faster writing it so) and contiguous elsewhere. What must hold wherever it flows, checked
here with fake CUDA tensors (no GPU needed): the op's fake says the strides the kernels
give, and every backward that hands a weight gradient to autograd (the opaque backward ops
and their decompositions Inductor compiles) gives it in its master's dtype and strides, as
its fake promises and AccumulateGrad keeps without a copy."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import commfx.ops  # noqa: F401
from commfx.kernels import weight_grad_empty
from commfx.ops import moe
from commfx.ops.decompositions import compute_decompositions

commfx = torch.ops.commfx


@pytest.mark.parametrize("device, dtype, transposed", [
    ("cuda", torch.bfloat16, True), ("cuda", torch.float32, True), ("cuda", torch.float64, False),
    ("cpu", torch.bfloat16, False), ("cpu", torch.float64, False),
])
def test_the_fake_gives_the_kernels_strides(device, dtype, transposed):
    with FakeTensorMode():
        g = torch.empty(10, 6, device=device, dtype=dtype)
        x = torch.empty(10, 4, device=device, dtype=dtype)
        counts = torch.empty(3, device=device, dtype=torch.int64)
        out = commfx.grouped_mm_weight_grad(g, x, counts)
    assert out.shape == (3, 6, 4)
    assert out.stride() == ((24, 1, 6) if transposed else (24, 4, 1))
    assert weight_grad_empty(torch.empty(0, dtype=dtype), 3, 6, 4).stride() == (24, 4, 1)  # the real CPU kernel


def test_a_column_major_gradient_is_copied_to_its_masters_layout_and_dtype():
    master = torch.randn(3, 6, 4, dtype=torch.float64)
    grad = torch.randn(3, 4, 6, dtype=torch.float32).transpose(1, 2)
    out = moe.as_master_gradient(grad, master)
    assert out.dtype == torch.float64 and out.stride() == master.stride()
    torch.testing.assert_close(out, grad.double(), rtol=0, atol=0)
    same = torch.randn_like(master)
    assert moe.as_master_gradient(same, master) is same


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_the_experts_backward_gives_weight_gradients_as_their_masters(compute):
    """expert_ffn_backward's body (what the op runs, and the form Inductor compiles) on fake
    CUDA rows in the plan's compute dtype with float32 masters. (packed_expert_ffn_backward
    ends the same way; its layout needs real CUDA factories: `make test-gpu` trains it.)"""
    assert compute_decompositions()[commfx.expert_ffn_backward.default] is moe.expert_ffn_backward._init_fn
    with FakeTensorMode():
        x = torch.empty(12, 8, device="cuda", dtype=compute)
        counts = torch.empty(4, device="cuda", dtype=torch.int64)
        gate_up = torch.empty(4, 10, 8, device="cuda", dtype=torch.float32)
        down = torch.empty(4, 8, 5, device="cuda", dtype=torch.float32)
        _, g_gate_up, g_down = moe.expert_ffn_backward._init_fn(torch.empty_like(x), x, counts, gate_up, down, "silu")
    for grad, master in ((g_gate_up, gate_up), (g_down, down)):
        assert grad.dtype == master.dtype and grad.stride() == master.stride()
