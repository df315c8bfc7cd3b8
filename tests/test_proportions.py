"""Bench models with real proportions (bench/proportions.py) and the matched emulated link."""

import pytest

from commfx.bench.proportions import (
    A100_PIPELINE, H100_CLUSTER, REAL_MODELS, compute_over_comm, gpt_moe_kwargs, matched_link, pipeline_compute_over_comm, scaled,
)

MOE_MODELS = sorted(name for name, model in REAL_MODELS.items() if not model.dense)
from commfx.cli.main import main
from commfx.models import load_model


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_scaling_keeps_experts_top_k_and_the_width_ratios(name):
    real = REAL_MODELS[name]
    small = scaled(real, hidden=128)
    assert (small.experts, small.top_k, small.hidden) == (real.experts, real.top_k, 128)
    assert small.expert_hidden / small.hidden == pytest.approx(real.expert_hidden / real.hidden, rel=0.02)
    assert small.vocab / small.hidden == pytest.approx(real.vocab / real.hidden, rel=0.01)
    assert small.expert_hidden % 4 == 0  # torch._grouped_mm's CPU rows: 16-byte multiples in float32
    model, _ = load_model("gpt-moe", **gpt_moe_kwargs(small), batch=2, seq=8)
    assert model.config.num_experts == real.experts and model.config.top_k == real.top_k


def test_mixtral_compute_over_comm_by_hand():
    """Mixtral-8x7B, one token through one MoE layer, forward and backward (3x forward):
    q and o projections 2 x 2 x 4096 x 4096, k and v (8 kv heads of 128) 2 x 2 x 4096 x 1024,
    two of eight experts with three 4096 x 14336 matrices; bf16 rows of 4096 dispatched
    and combined, forward and backward, half of them to the other node, over 400 Gb/s / 8."""
    flops = 3 * (2 * 2 * 4096 * 4096 + 2 * 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336 * 2)
    compute = flops / (0.4 * 989e12)
    comm = (4 * 2 * 4096 * 2) * 0.5 / (400e9 / 8 / 8)
    assert compute_over_comm(REAL_MODELS["mixtral-8x7b"], H100_CLUSTER) == pytest.approx(compute / comm, rel=1e-12)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_the_matched_link_gives_the_scaled_model_the_real_ratio(name):
    matched = matched_link(name, flops_per_rank=3e10, nodes=2)
    m = matched.model
    compute = 3 * (2 * 2 * m.hidden * m.heads * m.head_dim * 2 + 2 * 3 * m.hidden * m.expert_hidden * m.top_k) / 3e10
    comm = 4 * m.top_k * m.hidden * 4 * 0.5 / (matched.rate_bits / 8)  # float32 rows, half to the other node
    assert compute / comm == pytest.approx(compute_over_comm(REAL_MODELS[name]), rel=1e-9)


def test_gpt_2_5b_stage_compute_over_boundary_send_by_hand():
    """Optimus-CC's GPT-2.5B, one token: 52 / 4 = 13 layers a stage, each with q, k, v and o
    projections of 1,920 x 1,920 and an MLP of 2 x 1,920 x 7,680 (GPT's; three matrices of
    5,120 here), forward and backward (3x forward), on the stage's node of 8 A100s at 40% of
    312 TFLOP/s; its bf16 activation of 1,920 crosses the node's 200 Gb/s link."""
    flops = 13 * 3 * (4 * 2 * 1920 * 1920 + 2 * 2 * 1920 * 7680)
    compute = flops / (8 * 0.4 * 312e12)
    comm = 1920 * 2 / (200e9 / 8)
    assert pipeline_compute_over_comm(REAL_MODELS["gpt-2.5b"], A100_PIPELINE) == pytest.approx(compute / comm, rel=1e-12)


def test_the_pipeline_matched_link_gives_one_stage_the_real_ratio():
    """pp 2 on 2 nodes: two layers a stage; a token's float32 activation of `hidden` crosses."""
    matched = matched_link("gpt-2.5b", flops_per_rank=3e10, nodes=2, pp=2)
    m = matched.model
    assert (m.layers, m.experts, m.top_k, m.hidden) == (4, 1, 1, 256)
    compute = 2 * 3 * (4 * 2 * m.hidden * m.hidden + 2 * 3 * m.hidden * m.expert_hidden) / 3e10
    comm = m.hidden * 4 / (matched.rate_bits / 8)
    assert compute / comm == pytest.approx(pipeline_compute_over_comm(REAL_MODELS["gpt-2.5b"]), rel=1e-9)
    assert any("boundary send" in line for line in matched.lines())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "gpt-moe", "--proportions", "gpt-2.5b", "--inter-node", "100mbit"], "add --pp 2"),
        (["bench", "gpt-moe", "--proportions", "gpt-2.5b", "--pp", "2", "--nodes", "1", "--ranks-per-node", "2", "--inter-node", "auto",
          "--flops-per-rank", "1e10"], "needs at least 2 nodes"),
        (["bench", "gpt-moe", "--proportions", "gpt-2.5b", "--pp", "2", "--nodes", "3", "--inter-node", "auto", "--flops-per-rank", "1e10"],
         "give --nodes 2 --ranks-per-node 1 for --pp 2"),
        (["bench", "gpt-moe", "--inter-node", "auto", "--flops-per-rank", "2e10"], "add --proportions NAME"),
        (["bench", "gpt-moe-tiny", "--proportions", "mixtral-8x7b"], "scales the built-in gpt-moe"),
        (["bench", "gpt-moe", "--proportions", "gpt-5", "--inter-node", "100mbit"], "no such model; known: mixtral-8x7b"),
    ],
)
def test_proportions_errors_are_clear(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().out


def test_inter_node_auto_without_a_rate_measures_this_machine():
    """No --flops-per-rank: the link is sized from the scaled model's expert GEMMs timed here."""
    import argparse

    from commfx.cli.bench import _proportioned

    args = argparse.Namespace(proportions="mixtral-8x7b", model="gpt-moe", flops_per_rank=None, nodes=2, ranks_per_node=1, batch=None, pp=1)
    matched, inter_node = _proportioned(args, "auto,1ms")
    assert 1e8 < matched.flops_per_rank < 1e14  # a real rate, not the placeholder of 1 FLOP/s
    assert inter_node == f"{matched.rate_bits / 1e6:.2f}mbit,1ms"
    given = matched_link("mixtral-8x7b", flops_per_rank=matched.flops_per_rank * 2, nodes=2)
    assert given.rate_bits == pytest.approx(2 * matched.rate_bits)  # the link scales with the rate it was sized from
