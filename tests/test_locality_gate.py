"""locality_gate (LocMoE): GrAP, node-limited routing, the loss-injection op, the capacity floor."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfx.api import compile_program
from commfx.compiler.render import render
from commfx.models import load_model
from commfx.models.gpt_moe import GPTMoE, GPTMoEConfig
from commfx.ops import locality
from commfx.compiler.pass_manager import check_plan
from commfx.plan import Plan, PlanError

commfx_ops = torch.ops.commfx


def test_grap_against_hand_computed_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, -5.0, -6.0, 0.0, 2.0]])
    # groups of d/n = 2: means 1.5, 3.5, -5.5, 1.0; ReLU zeroes the third
    assert torch.equal(locality.grap_scores(x, 4), torch.tensor([[1.5, 3.5, 0.0, 1.0]]))
    assert torch.allclose(x @ locality.grap_gate_vectors(8, 4, torch.float32).t(), torch.tensor([[1.5, 3.5, -5.5, 1.0]]))
    with pytest.raises(ValueError, match="8 is not divisible by 3"):
        locality.grap_scores(x, 3)


def test_capacity_floor_against_hand_computed_values():
    # I_x(a, 1) = x^a and I_x(1/2, 1/2) = (2/pi) asin(sqrt x)
    assert locality.regularized_incomplete_beta(0.3, 2.5, 1.0) == pytest.approx(0.3**2.5, rel=1e-12)
    assert locality.regularized_incomplete_beta(0.7, 0.5, 0.5) == pytest.approx(2 / math.pi * math.asin(math.sqrt(0.7)), rel=1e-12)
    # d = 3: I_{δ²}(1/2, 1) = δ, so the floor is 1 / (n (1 - δ)); d = 2: 1 / (n (1 - (2/π) asin δ))
    assert locality.capacity_floor(0.5, 3, 4) == pytest.approx(0.5, rel=1e-12)
    assert locality.capacity_floor(0.5, 2, 2) == pytest.approx(0.75, rel=1e-12)
    assert locality.capacity_floor(0.0, 64, 8) == pytest.approx(1 / 8)  # no deviation: the uniform share
    # large d: (1/n) exp(δ² d / (2 - δ²)) grows the same way (log-ratio small against the exponent)
    exact, approx = locality.capacity_floor(0.1, 4096, 8), locality.capacity_floor_large_d(0.1, 4096, 8)
    assert exact > 1 and abs(math.log(exact / approx)) < 0.15 * math.log(approx * 8)


@settings(max_examples=60, deadline=None)
@given(
    num_nodes=st.integers(2, 4),
    per_node=st.integers(1, 4),
    tokens=st.integers(1, 24),
    data=st.data(),
)
def test_node_limited_routing_never_uses_more_than_m_nodes(num_nodes, per_node, tokens, data):
    max_nodes = data.draw(st.integers(1, num_nodes))
    k = data.draw(st.integers(1, max_nodes * per_node))
    fraction = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) if k <= per_node else 1.0
    home_node = data.draw(st.integers(0, num_nodes - 1))
    seed = data.draw(st.integers(0, 10_000))
    balance = data.draw(st.sampled_from([0.0, 1.0, 1.2]))
    expert_node = [e // per_node for e in range(num_nodes * per_node)]
    scores = torch.rand(tokens, num_nodes * per_node, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).softmax(-1)
    home = torch.tensor([n == home_node for n in expert_node])
    indices = locality.node_limited_topk(scores, k, expert_node, home, max_nodes, fraction, balance)
    nodes = torch.tensor(expert_node)[indices]
    for row, row_nodes in zip(indices.tolist(), nodes.tolist()):
        assert len(set(row)) == k  # k distinct experts
        assert len(set(row_nodes)) <= max_nodes
    off_node = int((nodes != home_node).any(1).sum())
    assert off_node <= int(fraction * tokens)
    if max_nodes == num_nodes and fraction == 1.0 and not balance:  # no limit: plain top-k
        assert torch.equal(indices.sort(1).values, scores.topk(k).indices.sort(1).values)


def test_balanced_routing_caps_every_expert_at_balance_times_its_node_mean():
    g = torch.Generator().manual_seed(0)
    expert_node = [e // 4 for e in range(8)]
    home = torch.tensor([n == 0 for n in expert_node])
    skew = torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0])  # a router that favours experts 0 and 1
    scores = (torch.randn(128, 8, generator=g, dtype=torch.float64) + skew).softmax(-1)
    free = locality.node_limited_topk(scores, 2, expert_node, home, 1, 0.25)
    capped = locality.node_limited_topk(scores, 2, expert_node, home, 1, 0.25, balance=1.2)
    nodes = torch.tensor(expert_node)

    def node_load(indices):
        counts = torch.bincount(indices.reshape(-1), minlength=8)
        return counts, [int(counts[nodes == n].sum()) for n in (0, 1)]

    counts, rows = node_load(capped)
    assert rows == node_load(free)[1]  # same tokens on each node: the cap moves rows inside a node
    for e in range(8):  # ceil(1.2 x node rows / 4)
        assert counts[e] <= math.ceil(1.2 * rows[expert_node[e]] / 4)
    assert node_load(free)[0].max() > math.ceil(1.2 * rows[0] / 4)  # the cap did something
    off = (nodes[capped] != 0).any(1)
    assert torch.equal(off, (nodes[free] != 0).any(1))  # the same tokens leave their node
    # a token keeps its best choice unless that expert was full of better-scoring tokens
    kept = (capped == free).all(1).float().mean()
    assert kept > 0.3


def test_loss_injection_leaves_outputs_unchanged_and_adds_the_loss_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    expert_node = [e // 4 for e in range(8)]
    home = torch.tensor([n == 1 for n in expert_node])

    def routed(inject: bool):
        probs = logits.softmax(-1)
        indices = locality.node_limited_topk(probs.detach(), 2, expert_node, home, 1, 0.5)
        weights = probs.gather(-1, indices)
        losses = locality.aux_losses(probs, indices, home, expert_node, 0.01, 0.3)
        return (commfx_ops.add_aux_loss(weights, losses, "test") if inject else weights), losses

    probe = torch.randn(10, 2, dtype=torch.float64, generator=g)
    injected, _ = routed(True)
    (got,) = torch.autograd.grad((injected * probe).sum(), logits)
    plain, losses = routed(False)
    assert torch.equal(injected, plain)  # the outputs do not change
    (want,) = torch.autograd.grad((plain * probe).sum() + losses.sum(), logits)
    assert (got - want).abs().max() <= 1e-12
    assert locality.LAST_AUX_LOSSES["test"] == pytest.approx(losses.tolist())
    balance, local = losses.tolist()
    assert f"aux losses test: balance {balance:.4f}  locality {local:.4f}" in locality.aux_loss_report()
    assert losses[1] > 0  # home is node 1, the batch's mass is spread: the locality loss is on


def test_golden_locality_gate_graph():
    from test_golden import check_golden

    model, inputs = load_model("gpt-moe-tiny")
    plan = Plan.from_cli("lift,locality_gate,expert_parallel", world_size=4, ranks_per_node=2)
    program = compile_program(model, plan, inputs)
    text = render(program.gm)
    check_golden({"distributed": text}, "gpt-moe-tiny.ep4.2x2.locality_gate", ("distributed",))
    assert text.count("commfx.locality_topk(") == sum(1 for b in program.regions.moe_blocks)


@pytest.mark.parametrize(
    "passes, ranks_per_node, message",
    [
        ("lift,locality_gate:max_nodes=3,expert_parallel", 2, "max_nodes=3 is larger than the 2 nodes"),
        ("lift,locality_gate,expert_parallel", 0, "no nodes"),
        ("lift,locality_gate,expert_parallel", 4, "one node holding all"),
        ("lift,locality_gate:gate=hashed,expert_parallel", 2, "is not one of"),
        ("lift,locality_gate:balance=0.5,expert_parallel", 2, "caps experts below their mean load"),
    ],
)
def test_plans_locality_gate_cannot_run_are_clear_errors(passes, ranks_per_node, message):
    with pytest.raises(PlanError, match=message):
        check_plan(Plan.from_cli(passes, world_size=4, ranks_per_node=ranks_per_node))


def test_grap_on_a_hidden_size_the_experts_do_not_divide_is_a_clear_error():
    model = GPTMoE(GPTMoEConfig(hidden_size=36, num_heads=4, num_experts=8))
    plan = Plan.from_cli("lift,locality_gate:gate=grap,expert_parallel", world_size=4, ranks_per_node=2)
    with pytest.raises(PlanError, match="hidden size 36 into 8 groups"):
        check_plan(plan, model)


def test_measured_capacity_floor_against_hand_computed_values():
    # gate vectors e1, e2, e3 (d = 3, n = 3): a token's cosine with its expert is one coordinate over its norm
    x = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 3.0]], dtype=torch.float64)
    gate = torch.eye(3, dtype=torch.float64) * 5.0  # the norm of a gate vector does not matter
    indices = torch.tensor([[0], [1]])
    delta = (1 / math.sqrt(5) + 1 / math.sqrt(10)) / 2  # 0.38172
    # d = 3: floor = 1 / (n (1 - δ)); as a capacity factor n * floor = 1 / (1 - δ) = 1.6174
    factor = 1 / (1 - delta)
    floor = commfx_ops.measure_capacity_floor(x, gate, indices, 3, 1.25, "hand")
    assert float(floor) == pytest.approx(factor, rel=1e-9)
    record = locality.LAST_CAPACITY["hand"]
    assert record["delta"] == pytest.approx(delta, rel=1e-12)
    assert record["used"] == pytest.approx(factor) and record["configured"] == 1.25
    assert record["rows_per_expert"] == math.ceil(factor * 2 * 1 / 3) == 2
    assert "delta 0.382  LocMoE floor 1.617  configured 1.25  -> factor 1.617 (2 rows per expert)" in locality.capacity_report()
    # a configured factor above the floor wins
    commfx_ops.measure_capacity_floor(x, gate, indices, 3, 2.5, "hand")
    assert locality.LAST_CAPACITY["hand"]["used"] == 2.5
    # at most E / k: then every expert may take every token
    aligned = torch.tensor([[1.0, 0.01, 0.0], [0.0, 1.0, 0.01]], dtype=torch.float64)
    assert float(commfx_ops.measure_capacity_floor(aligned, gate, indices, 3, 1.0, "hand")) == 3.0
    # GrAP (no weights): expert 0's gate vector averages units 0, 1 of d = 4
    token = torch.tensor([[2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    commfx_ops.measure_capacity_floor(token, None, torch.tensor([[0]]), 2, 1.0, "grap")
    assert locality.LAST_CAPACITY["grap"]["delta"] == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    assert locality.LAST_CAPACITY["grap"]["floor"] == pytest.approx(min(2 * locality.capacity_floor(1 / math.sqrt(2), 4, 2), 2.0))


def test_dispatch_uses_the_larger_of_floor_and_configured_capacity():
    x = torch.arange(12.0).reshape(6, 2)
    indices = torch.tensor([[0], [0], [0], [0], [1], [0]])
    for configured, floor, rows in [(1.0, 2.0, 6), (2.0, 1.0, 6), (1.0, 0.5, 3), (0.0, 2.0, 6)]:
        out, counts, slot = commfx_ops.moe_dispatch(x, indices, 2, configured, capacity_floor=torch.tensor(floor, dtype=torch.float64))
        assert out.shape[0] == (rows * 2 if configured > 0 else 6)  # dropless (0) ignores the floor
        if configured > 0:
            assert counts.tolist() == [rows, rows]
            assert int((slot >= 0).sum()) == min(5, rows) + 1  # expert 0 keeps `rows` of its 5 tokens


def test_capacity_mode_graph_measures_the_floor_and_dump_shows_both_factors():
    from test_golden import check_golden

    model, inputs = load_model("gpt-moe-tiny")
    plan = Plan.from_cli("lift,locality_gate,expert_parallel:capacity_factor=1.25", world_size=4, ranks_per_node=2)
    text = render(compile_program(model, plan, inputs).gm)
    check_golden({"distributed": text}, "gpt-moe-tiny.ep4.2x2.locality_gate.capacity", ("distributed",))
    assert text.count("commfx.measure_capacity_floor(") == 1
    assert "moe_dispatch(%x, %locality_topk_default, 4, 1.25, capacity_floor=%measure_capacity_floor_default)" in text
    assert "LocMoE floor" in text and "configured 1.25" in text


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hash_and_switch_baselines(precision):
    """Both baselines compile (under bf16 too: hash routing counts the router's rows, which
    exist before its insertion point, where the cast hidden states may not)."""
    model, inputs = load_model("gpt-moe-tiny")
    for gate, routed in [("hash", "commfx.ops.locality.hash_route(%l_input_ids_, %router_probs, 4)"), ("switch", "commfx.locality_topk(%detach, %home_experts_default, 1,")]:
        plan = Plan.from_cli(f"lift,locality_gate:gate={gate},expert_parallel", world_size=4)  # no nodes needed
        plan = dataclasses.replace(plan, precision=precision)
        check_plan(plan, model)
        text = render(compile_program(model, plan, inputs).gm)
        assert routed in text, text
    ids = torch.tensor([[3, 7, 3], [0, 1, 7]])
    got = locality.hash_route(ids, torch.zeros(6, 2), 4)
    assert got.shape == (6, 1) and torch.equal(got[0], got[2]) and torch.equal(got[1], got[5])
    assert got.reshape(-1).tolist() == [(i * 2654435761 % 2**32) % 4 for i in ids.reshape(-1).tolist()]
    with pytest.raises(RuntimeError, match="ids hold 6 tokens and the MoE input 5 rows"):
        locality.hash_route(ids, torch.zeros(5, 2), 4)



@pytest.mark.parametrize("top_k, fraction", [(1, 0.2), (2, 0.3)])
def test_default_off_node_share_follows_top_k_and_dump_notes_it(top_k, fraction):
    model, inputs = load_model("gpt-moe-tiny", top_k=top_k)
    plan = Plan.from_cli("lift,locality_gate,expert_parallel", world_size=4, ranks_per_node=2)
    program = compile_program(model, plan, inputs)
    assert [d["max_remote_fraction"] for d in program.decisions["locality_gate"].values()] == [fraction]
    assert f"top-{top_k} on <= 2 node(s), <= {fraction:g} of tokens off-node" in render(program.gm)
    why = "top-1: LocMoE table, RESULTS.md" if top_k == 1 else "top-k >= 2: as before"
    assert [n for n in program.notes if n.startswith("locality_gate:")] == [
        f"locality_gate: top-{top_k} router (1 layer): max_remote_fraction={fraction:g} by default ({why}); set it to override"
    ]


def test_a_set_off_node_share_is_kept_and_not_noted():
    from commfx.passes.locality_gate import LocalityGate, _default_notes

    decisions = {"layers.0.moe.experts": {"gate": "model", "top_k": 1, "max_remote_fraction": 0.5}}
    assert _default_notes(decisions, LocalityGate.Options(max_remote_fraction=0.5)) == []
    assert _default_notes(decisions, LocalityGate.Options(gate="switch")) == []
    assert len(_default_notes(decisions, LocalityGate.Options())) == 1
