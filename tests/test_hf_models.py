"""Tiny HF MoE models: they build offline, are seeded, convert to float64, and capture fullgraph."""

from __future__ import annotations

import pytest
import torch

from commfx.models.hf import HF_FAMILIES, build_hf_moe, choose_experts_implementation

FAMILIES = sorted(HF_FAMILIES)
REQUIRED = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"}


def _experts_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    # `use_experts_implementation` stamps these flags on every HF experts module.
    return [m for m in layer.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def _capture(model: torch.nn.Module, ids: torch.Tensor):
    """The project's capture recipe: dynamo, fullgraph, dynamic batch dim."""
    torch._dynamo.reset()
    ids = ids.clone()
    torch._dynamo.mark_dynamic(ids, 0)
    seen = {}

    def record(gm, example_inputs):
        seen["gm"], seen["example_inputs"] = gm, list(example_inputs)
        return gm.forward

    out = torch.compile(model, backend=record, fullgraph=True)(ids, use_cache=False)
    return out.logits, ids, seen


def test_required_families_present():
    assert REQUIRED <= set(HF_FAMILIES)
    deepseek = HF_FAMILIES["deepseek_v3"].config
    assert 1 < deepseek["topk_group"] < deepseek["n_group"], "deepseek_v3 must route group-limited"


def test_unknown_family_raises_with_supported_names():
    with pytest.raises(ValueError, match="supported: .*mixtral") as info:
        build_hf_moe("no_such_moe")
    assert "HF_FAMILIES" in str(info.value)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_builds_tiny_all_moe_as_transformers_returns_it(model_type):
    from transformers import PreTrainedModel

    model, (ids,) = build_hf_moe(model_type, batch=3, seq=5)
    config = model.config
    assert isinstance(model, PreTrainedModel) and model.training and config.use_cache
    assert config._experts_implementation != "batched_mm"  # transformers' default, untouched
    assert choose_experts_implementation(model) == "batched_mm"  # what a CPU run needs
    assert config._attn_implementation == HF_FAMILIES[model_type].attn_implementation
    assert ids.shape == (3, 5) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < config.vocab_size == 64
    assert config.hidden_size == 32 and len(model.model.layers) == 2
    for layer in model.model.layers:  # every decoder layer is an MoE layer
        (experts,) = _experts_modules(layer)
        assert experts.num_experts in (4, 8)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = model(ids, use_cache=False).logits
    assert out.shape == (3, 5, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize("model_type", FAMILIES)
def logits(model, ids):
    choose_experts_implementation(model)
    return model(ids, use_cache=False).logits


@pytest.mark.parametrize("model_type", FAMILIES)
def test_seeded_and_deterministic(model_type):
    rng_before = torch.get_rng_state()
    model_a, (ids_a,) = build_hf_moe(model_type, seed=0)
    model_b, (ids_b,) = build_hf_moe(model_type, seed=0)
    model_c, (ids_c,) = build_hf_moe(model_type, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before), "building must not consume the global RNG"

    state_a, state_b, state_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert any(not torch.equal(state_a[k], state_c[k]) for k in state_a)
    assert torch.equal(ids_a, ids_b) and not torch.equal(ids_a, ids_c)
    # Train mode, yet no randomness in the forward (no jitter, dropout 0).
    assert torch.equal(logits(model_a, ids_a), logits(model_a, ids_a))
    assert torch.equal(logits(model_a, ids_a), logits(model_b, ids_a))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_float64_is_the_float32_model_upcast(model_type):
    model32, (ids32,) = build_hf_moe(model_type)
    model64, (ids64,) = build_hf_moe(model_type, dtype=torch.float64)
    assert torch.equal(ids32, ids64)
    state32 = model32.state_dict()
    for name, tensor in model64.state_dict().items():
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float64, name
            assert torch.equal(tensor, state32[name].double()), name
    out = logits(model64, ids64)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_captures_fullgraph_with_dynamic_batch(model_type):
    model, (ids,) = build_hf_moe(model_type, dtype=torch.float64)
    choose_experts_implementation(model)
    out, marked_ids, seen = _capture(model, ids)
    assert torch.equal(out, model(ids, use_cache=False).logits)

    gm, example_inputs = seen["gm"], seen["example_inputs"]
    placeholders = gm.graph.find_nodes(op="placeholder")
    symints = [n for n in placeholders if isinstance(n.meta.get("example_value"), torch.SymInt)]
    assert len(symints) == 1, "exactly the batch size should be symbolic"
    assert sum(a is marked_ids for a in example_inputs) == 1
    for batch in (3, 5):
        new_ids = torch.randint(0, 64, (batch, ids.shape[1]), generator=torch.Generator().manual_seed(batch))
        args = [
            batch if isinstance(a, (int, torch.SymInt)) else new_ids if a is marked_ids else a
            for a in example_inputs
        ]
        result = gm(*args)
        result = result[0] if isinstance(result, (tuple, list)) else result
        assert result.shape == (batch, ids.shape[1], 64)
        torch.testing.assert_close(result, model(new_ids, use_cache=False).logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "model_type", [name for name in FAMILIES if "n_group" in HF_FAMILIES[name].config]
)
def test_group_limited_routing_prunes(model_type):
    """The group limit must change some token's experts, or the tiny config would not exercise it."""
    model, (ids,) = build_hf_moe(model_type, dtype=torch.float64)
    choose_experts_implementation(model)
    router = model.model.layers[0].mlp.gate
    assert 1 < router.num_group and router.topk_group < router.num_group
    inputs = []
    handle = router.register_forward_hook(lambda module, args, output: inputs.append(args[0]))
    try:
        model(ids, use_cache=False)
    finally:
        handle.remove()
    grouped = router(inputs[0])[2].sort(-1).values
    router.topk_group = router.num_group  # every group allowed: plain top-k
    try:
        ungrouped = router(inputs[0])[2].sort(-1).values
    finally:
        router.topk_group = HF_FAMILIES[model_type].config["topk_group"]
    assert (grouped != ungrouped).any(-1).sum() > 0


def test_model_args_set_fields_of_an_hf_config_and_an_unknown_field_is_named():
    from commfx.models import load_model

    model, _ = load_model("hf:llama", hidden_size=64, num_attention_heads=4)
    assert model.config.hidden_size == 64 and model.model.embed_tokens.weight.shape[1] == 64
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)  # the head width follows hidden_size
    with pytest.raises(ValueError, match="hf:llama's config has no hidden_sizes; --model-arg sets fields of LlamaConfig"):
        load_model("hf:llama", hidden_sizes=64)


def test_a_saved_transformers_directory_is_a_model_spec_with_its_weights(tmp_path, capsys):
    """A `save_pretrained` directory (what `commfx run --export` writes) loads as a model spec with
    the saved weights, and the CLI compiles it; a directory that is not a model is named."""
    from commfx.cli.main import main
    from commfx.models import load_model

    model, _ = build_hf_moe("mixtral", seed=3)
    model.save_pretrained(tmp_path / "saved")
    loaded, (ids,) = load_model(str(tmp_path / "saved"), batch=2, seq=6)
    assert ids.shape == (2, 6) and int(ids.max()) < model.config.vocab_size
    saved = dict(model.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in loaded.named_parameters())
    assert main(["dump", str(tmp_path / "saved"), "--passes", "lift,expert_parallel", "--world-size", "2"]) == 0
    dump = capsys.readouterr().out
    assert "commfx.moe_dispatch" in dump and "[expert_parallel:" in dump, dump[-2000:]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="does not load as a transformers causal LM"):
        load_model(str(tmp_path / "broken"))
