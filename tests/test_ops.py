"""Canonical ops: semantics, drop policy, gradients (float64 gradcheck) and fake impls (opcheck)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commfx.ops  # noqa: F401
from commfx.ops.moe import expert_capacity
from commfx.runtime.comm import install_default, local_scheduler

ops = torch.ops.commfx


def routing(n=6, k=2, e=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g, dtype=torch.float64)
    return logits, torch.topk(logits, k, dim=-1).indices


def test_dispatch_then_combine_is_the_weighted_sum_of_rows():
    logits, idx = routing()
    x = torch.randn(6, 3, dtype=torch.float64)
    weights = torch.rand(6, 2, dtype=torch.float64)
    rows, counts, slot = ops.moe_dispatch(x, idx, 4, 0.0)
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=4).tolist()
    # Rows are grouped by expert: each row's expert, in order, is non-decreasing.
    row_expert = torch.repeat_interleave(torch.arange(4), counts)
    assert torch.equal(idx.flatten()[torch.argsort(slot)], row_expert)
    y = ops.moe_combine(rows * 2, slot, weights)
    assert torch.allclose(y, 2 * x * weights.sum(1, keepdim=True))


def test_capacity_drops_later_tokens_and_pads():
    idx = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])
    x = torch.arange(4, dtype=torch.float64).unsqueeze(1) + 1
    capacity = expert_capacity(4, 2, 4, 1.0)
    assert capacity == 2
    rows, counts, slot = ops.moe_dispatch(x, idx, 4, 1.0)
    assert counts.tolist() == [2, 2, 2, 2] and rows.shape == (8, 1)
    # Expert 0 is picked by tokens 0, 1, 2: token 2's assignment is dropped.
    assert slot.view(4, 2)[2, 0] == -1 and (slot >= 0).sum() == 7
    assert rows[:2, 0].tolist() == [1.0, 2.0]  # tokens 0 and 1 keep their places
    assert rows[6:, 0].tolist() == [3.0, 0.0]  # expert 3: token 2, then padding
    y = ops.moe_combine(rows, slot, torch.ones(4, 2, dtype=torch.float64))
    assert y[2, 0] == 3.0  # only its expert-3 assignment survives


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=2, max_size=4))
def test_group_by_expert_round_trip(count_rows):
    counts = torch.tensor(count_rows, dtype=torch.int64)
    rows = torch.randn(int(counts.sum()), 2)
    grouped = ops.group_by_expert(rows, counts, False)
    assert torch.equal(ops.group_by_expert(grouped, counts, True), rows)
    # Expert-major: expert 0's rows from every source (sources in order), then expert 1's, ...
    sources, experts = counts.shape
    tags = [(s, e) for s in range(sources) for e in range(experts) for _ in range(int(counts[s, e]))]
    tagged = torch.tensor([[s, e] for s, e in tags], dtype=torch.float64).view(-1, 2)
    expected = sorted(tags, key=lambda se: (se[1], se[0]))
    assert [tuple(int(v) for v in r) for r in ops.group_by_expert(tagged, counts, False)] == expected


def test_router_matches_softmax_topk_normalise_and_its_gradient():
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w, i = ops.topk_router(logits, 2, True, torch.float64)
    p = torch.softmax(logits, -1)
    v, j = torch.topk(p, 2)
    assert torch.equal(i, j) and torch.allclose(w, v / v.sum(-1, keepdim=True))
    assert torch.autograd.gradcheck(lambda l: ops.topk_router(l, 2, True, torch.float64)[0], (logits,))
    assert torch.autograd.gradcheck(lambda l: ops.topk_router(l, 2, False, torch.float64)[0], (logits,))


@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_dispatch_combine_gradients(capacity_factor):
    _, idx = routing()
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        rows, _, slot = ops.moe_dispatch(x, idx, 4, capacity_factor)
        return ops.moe_combine(rows.sin(), slot, w)

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_expert_ffn_matches_per_expert_loop_and_gradcheck(activation):
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "relu": torch.relu}[activation]
    out = ops.expert_ffn(x, counts, gate_up, down, activation)
    pieces, start = [], 0
    for e, c in enumerate(counts.tolist()):
        h = x[start : start + c] @ gate_up[e].T
        g, u = h.chunk(2, -1)
        pieces.append((act(g) * u) @ down[e].T)
        start += c
    assert torch.allclose(out, torch.cat(pieces))
    assert torch.autograd.gradcheck(lambda *a: ops.expert_ffn(*a[:1], counts, *a[1:], activation), (x, gate_up, down))


def test_all_to_all_on_one_rank_and_its_gradient():
    install_default(local_scheduler())
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([[4]])
    assert torch.autograd.gradcheck(lambda t: ops.all_to_all(t, counts, counts, "ep"), (x,))


def test_fake_impls_agree_with_real_ones():
    _, idx = routing()
    x = torch.randn(6, 3)
    torch.library.opcheck(ops.moe_dispatch.default, (x, idx, 4, 0.0), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.topk_router.default, (torch.randn(6, 4), 2, True, torch.float32))
    rows, counts, slot = ops.moe_dispatch(x, idx, 4, 0.0)
    torch.library.opcheck(ops.moe_combine.default, (rows, slot, torch.rand(6, 2)))
    torch.library.opcheck(
        ops.expert_ffn.default, (rows, counts, torch.randn(4, 6, 3), torch.randn(4, 3, 3), "silu"), test_utils=("test_schema", "test_faketensor")
    )
