"""packed_expert_ffn's decomposition (ops/decompositions.py): the aten form Inductor fuses
around the grouped GEMMs equals the op, and a pack_experts plan's compiled regions hold no
packed_expert_ffn, only grouped GEMMs and aten ops."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func

import commfx.ops  # noqa: F401
from commfx.compiler.pipeline import compile_program
from commfx.compiler.sharding import shard_parameters
from commfx.models import load_model
from commfx.ops import decompositions
from commfx.ops.decompositions import compute_decompositions
from commfx.ops.grouped_gemm import grouped_mm, grouped_mm_weight_grad
from commfx.plan import Plan

commfx = torch.ops.commfx


def _case(v=7, k=2, experts=4, hidden=6, inner=5, seed=0):
    """Received rows with some assignments invalid (a row with no local expert at all, rows
    with one) and local expert 2 with no rows; float64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (v, k), generator=g)
    ids[ids == 2] = 3
    ids[0] = -1  # routed to no local expert
    ids[1, 0] = -1
    ids[4, 1] = -1
    weights = torch.rand(v, k, generator=g, dtype=torch.float64)
    weights[ids < 0] = 0  # what rank_dispatch sends
    x = torch.randn(v, hidden, generator=g, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    down = torch.randn(experts, hidden, inner, generator=g, dtype=torch.float64) / inner**0.5
    return x, ids, weights, gate_up, down


def _grads(fn, x, ids, weights, gate_up, down, activation, seed=1):
    leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    out = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3], activation)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def _decomposed(*args):
    """The op traced by aot_autograd with commfx's decompositions: forward and backward run
    the aten forms, eagerly."""
    compiled = aot_function(
        lambda *a: commfx.packed_expert_ffn(*a),
        fw_compiler=_no_packed_op, bw_compiler=_no_packed_op, decompositions=compute_decompositions(), dynamic=True,
    )
    return compiled(*args)


def _no_packed_op(gm, _example):
    names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("packed_expert_ffn" in name for name in names), names
    assert "commfx.grouped_mm.default" in names
    return make_boxed_func(gm)


@pytest.fixture(params=[True, False], ids=["padding cut", "padded"])
def cut_padding(request, monkeypatch):
    """Both layouts of the packed experts' form: the valid assignments only (the CPU's) and
    all V*k with static shapes (the GPU's), each checked here on the CPU."""
    monkeypatch.setattr(decompositions, "_cut_padding", lambda device: request.param)
    return request.param


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("k", [2, 3])
def test_the_decomposition_equals_the_op_with_invalid_assignments_and_an_empty_expert(activation, k, cut_padding):
    x, ids, weights, gate_up, down = _case(k=k)
    assert (ids == 2).sum() == 0 and (ids < 0).all(dim=1).any()
    want, want_grads = _grads(commfx.packed_expert_ffn, x, ids, weights, gate_up, down, activation)
    got, got_grads = _grads(_decomposed, x, ids, weights, gate_up, down, activation)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    for name, g, w in zip(("x", "weights", "gate_up", "down"), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=name)
    assert torch.all(got_grads[1][ids < 0] == 0)  # remote experts' weights: zero gradient here


def test_the_forms_alone_equal_the_op_and_its_backward(cut_padding):
    """The table's two entries called directly (no tracing), and a batch where every
    assignment is invalid (nothing for this rank's experts)."""
    table = compute_decompositions()
    for ids_of in (lambda ids: ids, lambda ids: torch.full_like(ids, -1)):
        x, ids, weights, gate_up, down = _case()
        ids = ids_of(ids)
        torch.testing.assert_close(table[commfx.packed_expert_ffn.default](x, ids, weights, gate_up, down, "silu"),
                                   commfx.packed_expert_ffn(x, ids, weights, gate_up, down, "silu"), rtol=0, atol=1e-10)
        grad_out = torch.randn_like(x)
        got = table[commfx.packed_expert_ffn_backward.default](grad_out, x, ids, weights, gate_up, down, "silu")
        want = commfx.packed_expert_ffn_backward(grad_out, x, ids, weights, gate_up, down, "silu")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_grouped_gemms_leave_rows_past_the_counts_out():
    """Rows past sum(counts) are padding: zero output rows, nothing in the weights' gradient."""
    x = torch.randn(9, 4, dtype=torch.float64)
    w = torch.randn(3, 5, 4, dtype=torch.float64)
    counts = torch.tensor([2, 0, 4])
    out = grouped_mm(x, w, counts)
    torch.testing.assert_close(out[:6], grouped_mm(x[:6], w, counts), rtol=0, atol=0)
    assert torch.all(out[6:] == 0)
    g = torch.randn(9, 5, dtype=torch.float64)
    torch.testing.assert_close(grouped_mm_weight_grad(g, x, counts), grouped_mm_weight_grad(g[:6], x[:6], counts), rtol=0, atol=0)
    with pytest.raises(ValueError, match="must be non-negative and sum to"):
        grouped_mm(x[:5], w, counts)


def _host_syncs(gm) -> list[str]:
    """aten nodes that read a value back to the host, in a graph and its compiled regions."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            found += _host_syncs(gm.get_submodule(node.target).graph_module)
        elif node.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.item.default):
            found.append(node.name)
    return found


def test_a_pack_experts_plan_compiles_its_regions_without_the_packed_op():
    """gpt-moe under pack_experts at world 1, float64: the regions Inductor compiles (with
    the decompositions) hold no packed_expert_ffn and none of the packed exchange's glue
    ops (metadata columns, the sum of returned rows, their gradients), the expert GEMMs
    stay grouped GEMMs (the backward's recomputed hidden layer merged with the forward's),
    and a step equals the interpreted one."""
    from test_compiled_regions import _targets, _train_once

    model, inputs = load_model("gpt-moe", seed=0, dtype=torch.float64)
    program = compile_program(model, Plan.from_cli("lift,expert_parallel,pack_experts", world_size=1), inputs)
    shard_parameters(program, 0)
    want_loss, want_grads, plain = _train_once(copy.deepcopy(program.gm), inputs, "interpret")
    packed = plain["forward"].graph.find_nodes(op="call_function", target=commfx.packed_expert_ffn.default)
    assert packed
    loss, grads, compiled = _train_once(copy.deepcopy(program.gm), inputs, "inductor")
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-10)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    forward, backward = (_targets(compiled[phase]) for phase in ("forward", "backward"))
    assert not any(name.startswith("packed_expert_ffn") for name in forward + backward), (forward, backward)
    glue = ("attach_meta", "detach_meta", "scatter_add_tokens", "rank_dispatch_backward")
    assert not any(name.startswith(glue) for name in forward + backward), (forward, backward)  # opened: fused
    assert "rank_dispatch" in forward  # its row count depends on the routing: the op stays
    # on the CPU the valid assignments' count is the only read (the backward reuses the forward's layout)
    syncs = {phase: _host_syncs(compiled[phase]) for phase in ("forward", "backward")}
    reads = ("_local_scalar_dense", "item")
    assert syncs["forward"] and all(name.startswith(reads) for name in syncs["forward"] + syncs["backward"]), syncs
    for phase in ("forward", "backward"):
        report = compiled[phase].meta["commfx_regions"]
        assert report.failed_nodes <= 0.1 * sum(report.sizes), (phase, report.notes)
    assert forward.count("grouped_mm") == 2 * len(packed)
    assert backward.count("grouped_mm") == forward.count("grouped_mm")
    assert backward.count("grouped_mm_weight_grad") == forward.count("grouped_mm")
