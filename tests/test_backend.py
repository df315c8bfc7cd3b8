"""torch.compile(model, backend=commfx.backend(plan)) equals the float64 reference on 2 ranks."""

import sys
from pathlib import Path

import torch
from importlib.metadata import entry_points

from commfx.models import load_model
from commfx.runtime.launcher import launch
from commfx.verify import probes


def test_backend_is_registered_by_name():
    names = {ep.name for ep in entry_points(group="torch_dynamo_backends")}
    assert "commfx" in names


def test_compiled_model_matches_reference_on_two_ranks():
    sys.path.insert(0, str(Path(__file__).parent))
    world, batch = 2, 5
    results = launch("dist_workers:compiled_with_backend", world, {"batch": batch}, timeout_s=300)
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=batch)
    ref = model(ids)
    ((ref * probes([ref], batch, 0)[0]).sum() / world).backward()  # mean reduction over ranks
    out = torch.cat([r["output"] for r in results])
    assert (out - ref).abs().max() <= 1e-10
    for name, param in model.named_parameters():
        for r in results:
            assert (r["grads"][name] - param.grad).abs().max() <= 1e-10, name
    # aot_autograd's backward graph holds the backward all-to-alls (2 per MoE layer, 2 layers).
    assert [r["backward_all_to_alls"] for r in results] == [4] * world


import pytest


@pytest.mark.parametrize("dynamic", [None, False])
def test_new_shapes_recompile_without_collectives_even_on_one_rank(dynamic):
    """A second batch size on rank 0 only, then a new sequence length: dynamo recompiles
    (with dynamic=False, on rank 0 alone), the backend's compile runs no collective, and every
    output equals eager. partition_a2a:k=2 works in the backend."""
    sys.path.insert(0, str(Path(__file__).parent))
    results = launch("dist_workers:backend_shapes", 2, {"dynamic": dynamic}, timeout_s=300)
    model, _ = load_model("gpt-moe-tiny", dtype=torch.float64)
    for result in results:
        for ids, got in result["outputs"]:
            assert (got - model(ids)).abs().max() <= 1e-10
