"""The supported range's ends: the transformers release installed here (the pinned 5.24 in the
main venv, the oldest supported release in `make test-hf-oldest`'s venv), and graphs dynamo
hands the backend without any of the user's tensors.

`make test-hf-oldest` runs this whole file, the slow cases too, on the oldest release.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from commfx.models import load_model
from commfx.models.hf import HF_FAMILIES
from commfx.passes.lift import HF_FLAGS_ADDED_LATER, find_experts_modules
from commfx.plan import Plan

# Families whose experts the recognisers take; gpt-oss's transposed, biased experts are reported by name.
UNRECOGNISED = {"gpt_oss"}
RECOGNISED = tuple(f for f in HF_FAMILIES if f not in UNRECOGNISED)


def _experts(family: str) -> list:
    model, _ = load_model(f"hf:{family}")
    return [(path, pattern) for path, module, pattern in find_experts_modules(model) if path.endswith("experts")]


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_every_experts_module_of_the_installed_release_is_recognised(family):
    """Each layer's experts match a pattern (none for gpt-oss), whatever flags this release sets."""
    found = _experts(family)
    assert len(found) == 2, found  # two MoE layers in every tiny config
    if family in UNRECOGNISED:
        assert all(pattern is None for _, pattern in found), found
    else:
        assert all(pattern is not None and pattern.name.startswith("HF v5 gated") for _, pattern in found), found


def test_a_layout_flag_that_an_older_release_predates_reads_as_its_old_meaning():
    """Releases before a flag existed (5.17-5.19 set no has_post_expert_norm) still match;
    the flag set to the layout the pattern cannot lift does not."""
    model, _ = load_model("hf:mixtral")
    experts = model.model.layers[0].mlp.experts
    for flag in HF_FLAGS_ADDED_LATER:
        experts.__dict__.pop(flag, None)
    assert find_experts_modules(model)[0][2] is not None
    experts.has_post_expert_norm = True
    assert find_experts_modules(model)[0][2] is None
    experts.has_post_expert_norm = False
    experts.has_bias = True
    assert find_experts_modules(model)[0][2] is None


# ------------------------------------------------------------ graphs without user inputs


class MaskThenLayer(nn.Module):
    """Mask code cut off by graph breaks, as dynamo cuts HF's: the middle graph takes no user
    tensor, only a parameter (`scale`); the last one takes the input and the mask."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=torch.float64)
        self.scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x):
        torch._dynamo.graph_break()
        mask = torch.triu(torch.ones(4, 4, dtype=torch.float64), diagonal=1) * self.scale
        torch._dynamo.graph_break()
        return (self.proj(x) @ mask).sum()


def test_backend_runs_a_graph_without_user_inputs_unchanged():
    from commfx.backend import backend

    torch.manual_seed(0)
    model, x = MaskThenLayer(), torch.randn(3, 4, dtype=torch.float64)
    compiled_backend = backend(Plan.from_cli("lift,expert_parallel", world_size=1), model=model)
    out = torch.compile(model, backend=compiled_backend)(x)
    out.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(x)
    ref.backward()
    assert (out - ref).abs() <= 1e-12
    for name, param in model.named_parameters():
        assert (got[name] - param.grad).abs().max() <= 1e-12, name
    # Only the graph with the user's input became a commfx program; the mask graph ran as traced.
    assert len(compiled_backend.programs) == 1


def test_backend_called_directly_with_a_graph_that_has_no_inputs():
    from commfx.backend import backend

    def mask():
        return torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)

    gm = torch.fx.symbolic_trace(mask)
    assert not [n for n in gm.graph.nodes if n.op == "placeholder"]
    run = backend(Plan.from_cli("lift,expert_parallel", world_size=1))(gm, [])
    assert torch.equal(run(), mask())


# ------------------------------------------------------------- every family, both doors


@pytest.mark.slow
@pytest.mark.distributed
def test_every_recognised_family_verifies_at_world_2():
    """distributed vs the single-process float64 model, every recognised family, one launch."""
    from commfx.verify import VerifyCase, verify

    cases = [VerifyCase(f"hf:{family}", Plan.from_cli("lift,expert_parallel", world_size=2), batch=3) for family in RECOGNISED]
    for family, report in zip(RECOGNISED, verify(cases, 2, timeout_s=900)):
        assert report.ok, (family, report.failures, report.max_diff)
        assert report.output_diff <= 1e-10, family


@pytest.mark.slow
@pytest.mark.distributed
def test_compile_door_trains_a_raw_mixtral_on_2_ranks():
    """torch.compile(model, backend=commfx.backend(plan, model=model)) on MixtralForCausalLM as
    transformers builds it, 3 SGD steps with HF's loss on 2 ranks: each step's loss and the
    final weights equal eager training on the same rows (float64, gradients averaged)."""
    from commfx.models.hf import choose_experts_implementation
    from commfx.runtime.launcher import launch
    from commfx.verify import split_batch

    sys.path.insert(0, str(Path(__file__).parent))
    world, steps, lr = 2, 3, 0.1
    kwargs = {"family": "mixtral", "passes": "lift,expert_parallel", "steps": steps, "lr": lr}
    results = launch("compat_workers:compile_door_trains", world, kwargs, timeout_s=600)
    model, (ids,) = load_model("hf:mixtral", dtype=torch.float64, batch=2 * world)
    choose_experts_implementation(model)  # eager float64: the default grouped_mm may take no float64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses = [model(input_ids=split_batch(ids, world, r), labels=split_batch(ids, world, r), use_cache=False).loss for r in range(world)]
        (sum(losses) / world).backward()
        optimizer.step()
        for rank in range(world):
            assert (results[rank]["losses"][step] - losses[rank]).abs() <= 1e-10, (step, rank)
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    for name, param in model.named_parameters():
        for rank in range(world):
            assert (results[rank]["params"][name] - param.detach()).abs().max() <= 1e-10, (rank, name)
