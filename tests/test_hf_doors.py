"""Hugging Face MoE models exactly as transformers returns them, through every door.

`hf:<model_type>` builds the raw `*ForCausalLM` (KV cache on, transformers' default experts
implementation): no wrapper, no config edits. Equivalence is float64, outputs and every
gradient, against the single-process model on the whole batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from commfx.models.hf import HF_FAMILIES
from commfx.plan import Plan, PlanError
from commfx.verify import VerifyCase, verify

MODEL_FILES = Path(__file__).parent / "model_files"
# Nine families through distribute; partition_a2a (Lina) on for five of them. The default run
# takes three that between them cover plain and partitioned expert parallelism and a float32
# router; the other six (one launch, about 2 CPU-minutes) run under `make test-all`.
DEFAULT_FAMILIES = ("mixtral", "deepseek_v3", "granitemoe")
FAMILIES = {
    "mixtral": "lift,expert_parallel",
    "qwen2_moe": "lift,expert_parallel,partition_a2a:k=2",
    "qwen3_moe": "lift,expert_parallel",
    "olmoe": "lift,expert_parallel,partition_a2a:k=2",
    "deepseek_v2": "lift,expert_parallel",
    "deepseek_v3": "lift,expert_parallel,partition_a2a:k=2",
    "glm4_moe": "lift,expert_parallel",
    "ernie4_5_moe": "lift,expert_parallel,partition_a2a:k=2",
    "granitemoe": "lift,expert_parallel,partition_a2a:k=2",
}
# Routers these models compute in float32 on purpose (DeepSeek's rule, shared by GLM4 and Ernie).
FLOAT32_ROUTERS = {"deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe"}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "families",
    [
        pytest.param(DEFAULT_FAMILIES, id="default"),
        pytest.param(tuple(f for f in FAMILIES if f not in DEFAULT_FAMILIES), id="rest", marks=pytest.mark.slow),
    ],
)
def test_raw_hf_families_through_distribute_equal_the_model(families):
    cases = [VerifyCase(f"hf:{family}", Plan.from_cli(FAMILIES[family], world_size=2), batch=3) for family in families]
    reports = verify(cases, 2, timeout_s=600)
    for family, report in zip(families, reports):
        assert report.ok, (family, report.failures, report.max_diff)
        assert report.output_diff <= 1e-10, family
        judged = set(report.low_precision)
        if family in FLOAT32_ROUTERS:
            assert judged == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}, (family, judged)
            assert all("float32" in why for _, why in report.low_precision.values())
        else:
            assert not judged, (family, judged)
        # Everything outside the declared regions is held to 1e-10.
        assert all(diff <= 1e-10 for name, diff in report.grad_diffs.items() if name not in judged), family


@pytest.mark.slow
@pytest.mark.distributed
def test_a_real_bug_in_a_float32_region_still_fails():
    plan = Plan.from_cli("lift,expert_parallel", world_size=2)
    (report,) = verify([VerifyCase(f"{MODEL_FILES / 'perturbed_router.py'}:build", plan)], 2, timeout_s=300)
    assert not report.ok
    assert "outputs" in report.failures
    gate = "model.layers.0.mlp.gate.weight"
    assert gate in report.low_precision, "the perturbed router is a declared float32 region"
    assert gate in report.failures, (report.grad_diffs[gate], report.tolerance_of(gate))


@pytest.mark.distributed
def test_verify_handles_tied_embeddings():
    plan = Plan.from_cli("lift,expert_parallel", world_size=2)
    (report,) = verify([VerifyCase(f"{MODEL_FILES / 'tied_embeddings.py'}:build", plan)], 2, timeout_s=300)
    assert report.ok, (report.failures, report.max_diff)
    assert "model.embed_tokens.weight" in report.grad_diffs and "lm_head.weight" not in report.grad_diffs


def test_gpt_oss_is_reported_by_name():
    from commfx.compiler.pipeline import compile_program
    from commfx.models import load_model

    assert "gpt_oss" in HF_FAMILIES
    model, inputs = load_model("hf:gpt_oss")
    with pytest.raises(PlanError, match="GptOss") as info:
        compile_program(model, Plan.from_cli("lift,expert_parallel", world_size=2), inputs)
    assert "model.layers.0.mlp.experts" in str(info.value)


def test_raw_model_keeps_its_output_type_and_config():
    """compile_program on a raw HF model: the graph returns logits inside the model's own
    ModelOutput, computes HF's loss from labels=, and leaves the user's config as it was."""
    from torch.utils import _pytree as pytree

    from commfx.compiler.pipeline import compile_program
    from commfx.models import load_model

    model, (ids,) = load_model("hf:qwen3_moe", dtype=torch.float64)
    program = compile_program(model, Plan.from_cli("lift", world_size=1), (ids,), {"labels": ids})
    assert model.config.use_cache is True
    assert program.input_names == ["input_ids", "labels"]
    from commfx.runtime.comm import install_default, local_scheduler

    install_default(local_scheduler())
    out = pytree.tree_unflatten(list(program.gm(ids, ids)), program.out_spec)
    ref = model(input_ids=ids, labels=ids, use_cache=False)
    assert type(out) is type(ref) and set(out.keys()) == {"loss", "logits"}
    assert (out.logits - ref.logits).abs().max() <= 1e-10
    assert (out.loss - ref.loss).abs() <= 1e-10


@pytest.mark.distributed
@pytest.mark.parametrize(
    "family,passes",
    [
        pytest.param("mixtral", "lift,expert_parallel", marks=pytest.mark.slow),
        ("qwen3_moe", "lift,expert_parallel,partition_a2a:k=2"),
        pytest.param("olmoe", "lift,expert_parallel", marks=pytest.mark.slow),
    ],
)
def test_backend_and_distribute_equal_eager_with_hf_loss(family, passes):
    """torch.compile(model, backend=commfx.backend(plan)) and commfx.distribute on a raw HF
    model called with input_ids= and labels=: HF's own loss, logits and every gradient equal
    eager in float64 (each rank's loss is a mean over its tokens; gradients are averaged)."""
    import sys

    from commfx.models import load_model
    from commfx.models.hf import choose_experts_implementation
    from commfx.runtime.launcher import launch
    from commfx.verify import split_batch

    sys.path.insert(0, str(Path(__file__).parent))
    world = 2
    results = launch("dist_workers:hf_backend_and_distribute", world, {"family": family, "passes": passes}, timeout_s=300)
    model, (ids,) = load_model(f"hf:{family}", dtype=torch.float64, batch=2 * world)
    choose_experts_implementation(model)
    refs = [model(input_ids=split_batch(ids, world, r), labels=split_batch(ids, world, r), use_cache=False) for r in range(world)]
    (sum(ref.loss for ref in refs) / world).backward()
    for door in ("backend", "distribute"):
        for rank, (result, ref) in enumerate(zip(results, refs)):
            got = result[door]
            assert got["type"] == type(ref).__name__, door
            assert (got["loss"] - ref.loss).abs() <= 1e-10, (door, rank)
            assert (got["logits"] - ref.logits).abs().max() <= 1e-10, (door, rank)
            placement = got.get("placement", {})
            for name, param in model.named_parameters():
                expected = param.grad
                if name in placement:
                    start, stop = placement[name]
                    expected = expected[start:stop]
                assert (got["grads"][name] - expected).abs().max() <= 1e-10, (door, rank, name)


def test_backend_rejects_gpt_oss_by_name():
    from commfx.backend import backend

    model, (ids,) = __import__("commfx.models", fromlist=["load_model"]).load_model("hf:gpt_oss")
    compiled = torch.compile(model, backend=backend(Plan.from_cli("lift,expert_parallel", world_size=1)))
    with pytest.raises(Exception, match=r"unrecognised MoE-like modules: model\.layers\.0\.mlp\.experts \(GptOssExperts\)"):
        compiled(ids)


def test_keyword_inputs_with_an_attention_mask():
    """input_ids=, attention_mask= (with padding) and labels=, passed by keyword, reach the
    graph by name; the graph equals the model on them."""
    from torch.utils import _pytree as pytree

    from commfx.compiler.pipeline import compile_program
    from commfx.models import load_model
    from commfx.runtime.comm import install_default, local_scheduler
    from commfx.runtime.module import graph_inputs

    model, (ids,) = load_model("hf:mixtral", dtype=torch.float64)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first sequence
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    program = compile_program(model, Plan.from_cli("lift", world_size=1), batch)
    assert program.input_names == ["input_ids", "attention_mask", "labels"]
    install_default(local_scheduler())
    flat = program.gm(*graph_inputs(program, (), {"labels": ids, "attention_mask": mask, "input_ids": ids}))
    out = pytree.tree_unflatten(list(flat), program.out_spec)
    ref = model(**batch, use_cache=False)
    assert (out.logits - ref.logits).abs().max() <= 1e-10 and (out.loss - ref.loss).abs() <= 1e-10
