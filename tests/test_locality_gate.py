"""locality_gate (LocMoE): GrAP, node-limited routing, the loss-injection op, the capacity floor."""

from __future__ import annotations

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
from commfx.passes import check_plan
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
    expert_node = [e // per_node for e in range(num_nodes * per_node)]
    scores = torch.rand(tokens, num_nodes * per_node, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).softmax(-1)
    home = torch.tensor([n == home_node for n in expert_node])
    indices = locality.node_limited_topk(scores, k, expert_node, home, max_nodes, fraction)
    nodes = torch.tensor(expert_node)[indices]
    for row, row_nodes in zip(indices.tolist(), nodes.tolist()):
        assert len(set(row)) == k  # k distinct experts
        assert len(set(row_nodes)) <= max_nodes
    off_node = int((nodes != home_node).any(1).sum())
    assert off_node <= int(fraction * tokens)
    if max_nodes == num_nodes and fraction == 1.0:  # no limit: plain top-k
        assert torch.equal(indices.sort(1).values, scores.topk(k).indices.sort(1).values)


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
    assert losses[1] > 0  # home is node 1, the batch's mass is spread: the locality loss is on


def test_golden_locality_gate_graph():
    from test_golden import check_golden

    model, inputs = load_model("gpt-moe-tiny")
    plan = Plan.from_cli("lift,locality_gate,expert_parallel", world_size=4, ranks_per_node=2)
    program = compile_program(model, plan, inputs)
    text = render(program.gm)
    check_golden({"distributed": text}, "gpt-moe-tiny.ep4.2x2.locality_gate", ("distributed",))
    assert text.count("commfx.locality_topk(") == sum(1 for b in program.annotations["moe_blocks"])


@pytest.mark.parametrize(
    "passes, ranks_per_node, message",
    [
        ("lift,locality_gate:max_nodes=3,expert_parallel", 2, "max_nodes=3 is larger than the 2 nodes"),
        ("lift,locality_gate,expert_parallel", 0, "no nodes"),
        ("lift,locality_gate,expert_parallel", 4, "one node holding all"),
        ("lift,locality_gate:gate=hashed,expert_parallel", 2, "is not one of"),
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
