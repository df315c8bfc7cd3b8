"""capture + lift, single process: canonical ops appear and the function is unchanged (float64)."""

import copy

import pytest
import torch

from commfx.api import compile_program
from commfx.compiler.capture import CaptureError, capture
from torch.utils import _pytree as pytree

from commfx.models.hf import choose_experts_implementation, training_forward
from commfx.models import load_model
from commfx.plan import Plan
from commfx.runtime.comm import install_default, local_scheduler

commfx_ops = torch.ops.commfx


def commfx_targets(gm):
    return [n.target._opname for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "commfx"]


def assert_same_function(spec, passes="lift", **kw):
    """The rewritten graph equals the original model: outputs and every gradient, float64."""
    model, (ids,) = load_model(spec, dtype=torch.float64, **kw)
    choose_experts_implementation(model)  # what capture does to its copy; float64 needs it
    program = compile_program(copy.deepcopy(model), Plan.from_cli(passes, world_size=1), (ids,))
    install_default(local_scheduler())
    with training_forward(model):
        out, ref = program.gm(ids)[0], pytree.tree_leaves(model(ids))[0]
    probe = torch.randn_like(ref)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    assert (out - ref).abs().max() <= 1e-10
    rewritten = dict(program.gm.named_parameters())
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert (rewritten[name].grad - param.grad).abs().max() <= 1e-10, name
    return program


def test_capture_makes_params_attributes_and_batch_symbolic():
    model, (ids,) = load_model("gpt-moe-tiny")
    program = capture(model, (ids,))
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 1
    attrs = {n.target for n in program.graph.nodes if n.op == "get_attr"}
    assert attrs == {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    # One graph serves any batch size.
    for batch in (2, 5):
        assert torch.allclose(program.gm(ids[:batch])[0], model(ids[:batch]))


def test_graph_break_names_the_line_and_the_fix():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum().item() > 0:  # data-dependent Python control flow
                return x * 2
            return x

    with pytest.raises(CaptureError, match=r"(?s)graph break at .*test_capture_lift.py:\d+.*data-dependent Python control flow"):
        capture(Branchy(), (torch.randn(4, 3),))


def test_builtin_model_lifts_router_and_experts():
    program = assert_same_function("gpt-moe")
    targets = commfx_targets(program.gm)
    assert targets.count("topk_router") == 2 and targets.count("expert_ffn") == 2
    assert program.regions.kept_routers == [] and program.regions.unmatched_moe == []
    for node in program.graph.nodes:
        if getattr(node.target, "namespace", None) == "commfx":
            assert node.meta["commfx"]["pass"] == "lift"


@pytest.mark.parametrize(
    "family, router_lifted",
    [("mixtral", True), ("qwen2_moe", True), ("olmoe", True), ("deepseek_v3", False), ("gpt_oss", None)],
)
def test_hf_families(family, router_lifted):
    """Softmax routers are lifted; group-limited ones are kept verbatim; shared experts stay."""
    if router_lifted is None:
        # gpt-oss experts are transposed, interleaved and biased: reported, not silently mangled.
        model, (ids,) = load_model(f"hf:{family}")
        with pytest.warns(UserWarning, match=r"no recogniser matches them.*GptOssExperts"):
            program = compile_program(model, Plan.from_cli("lift", world_size=1), (ids,))
        assert program.regions.moe_blocks == []
        return
    program = assert_same_function(f"hf:{family}")
    targets = commfx_targets(program.gm)
    assert targets.count("expert_ffn") == 2
    assert (targets.count("topk_router") == 2) == router_lifted
    assert bool(program.regions.kept_routers) != router_lifted


def test_expert_parallel_on_one_rank_is_the_identity_function():
    program = assert_same_function("gpt-moe", passes="lift,expert_parallel")
    assert commfx_targets(program.gm).count("all_to_all") == 4


def test_builtin_experts_grouped_matmul_is_the_per_row_function_with_empty_experts():
    """Experts.implementation="grouped_mm" (what the peers run eagerly) computes the per-row
    form's function, values and gradients, float32, with experts that get no rows."""
    from commfx.models.gpt_moe import Experts, GPTMoEConfig

    torch.manual_seed(0)
    experts = Experts(GPTMoEConfig(hidden_size=16, num_experts=6, expert_hidden=8))
    x = torch.randn(10, 16)
    indices = torch.randint(0, 3, (10, 2))  # experts 3, 4 and 5 get nothing
    weights = torch.rand(10, 2)
    results = []
    for implementation in ("per_row", "grouped_mm"):
        experts.implementation = implementation
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        out = experts(xi, indices, weights)
        out.pow(2).sum().backward()
        results.append((out.detach(), xi.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for per_row, grouped in zip(*results):
        torch.testing.assert_close(grouped, per_row, rtol=1e-4, atol=1e-5)  # float32, sums in another order
    assert results[1][2][3:].abs().max() == 0  # no rows, no gradient
