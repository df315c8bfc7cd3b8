"""Functions the distributed tests run on every rank (imported by the worker processes)."""

import os

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.verify import split_batch


def die_mid_step(rank: int, world_size: int, dying_rank: int) -> str:
    model, (ids,) = load_model("gpt-moe-tiny")
    local = (split_batch(ids, world_size, rank),)
    dm = distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size), local)
    for step in range(3):
        if step == 1 and rank == dying_rank:
            os._exit(17)
        dm(*local).sum().backward()
    return "finished"


def wrong_world_size(rank: int, world_size: int) -> str:
    model, (ids,) = load_model("gpt-moe-tiny")
    distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size + 1), (ids,))
    return "no error"


def shard_and_checkpoint(rank: int, world_size: int) -> dict:
    model, (ids,) = load_model("gpt-moe", seed=3)
    full = sum(p.numel() for p in model.parameters())
    expert_full = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    local = (split_batch(ids, world_size, rank),)
    plan = Plan.from_cli("lift,expert_parallel", world_size=world_size)
    dm = distribute(model, plan, local)
    before = dm(*local).detach()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dm.state_dict().items()}
    with torch.no_grad():
        for p in dm.parameters():
            p.add_(1.0)
    changed = not torch.equal(dm(*local).detach(), before)
    dm.load_state_dict(state)
    restored = torch.equal(dm(*local).detach(), before)
    bad = dict(state)
    bad["_extra_state"] = {"placement": {k: [0, 1] for k in dm.placement}, "world_size": world_size}
    try:
        dm.load_state_dict(bad)
        mismatch_error = ""
    except ValueError as error:
        mismatch_error = str(error)
    return {
        "full": full,
        "expert_full": expert_full,
        "local": sum(p.numel() for p in dm.parameters()),
        "changed": changed,
        "restored": restored,
        "mismatch_error": mismatch_error,
    }


def compiled_with_backend(rank: int, world_size: int, batch: int) -> dict:
    from commfx.backend import backend
    from commfx.verify import probes

    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=batch)
    be = backend(Plan.from_cli("lift,expert_parallel", world_size=world_size))
    compiled = torch.compile(model, backend=be, fullgraph=True)
    local = split_batch(ids, world_size, rank)
    out = compiled(local)
    probe = split_batch(probes([out], ids.shape[0], 0)[0], world_size, rank)
    (out * probe).sum().backward()
    backward = be.graphs[0]["backward"]
    return {
        "output": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "backward_all_to_alls": sum(n.target is torch.ops.commfx.all_to_all.default for n in backward.graph.nodes),
    }
