"""Functions the hierarchical_a2a:enabled=auto tests run on every rank (imported by the worker processes)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.verify import split_batch

BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# 2 nodes x 2 ranks: a slow inter-node link, fast links inside a node, cheap collectives:
# gpt-moe-tiny's dispatch goes hierarchical (a sixth of its off-node rows repeat), its combine flat
MIXED_FIGURES = {"inter_node_bandwidth": 2.5e6, "inter_node_latency_s": 1e-3, "intra_node_bandwidth": 50e9, "collective_overhead_s": 20e-6}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BIT_VIEWS[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def mixed_program_equals_flat(rank: int, world_size: int, ranks_per_node: int) -> dict:
    """gpt-moe-tiny forward and backward in float64 under the flat plan and under
    hierarchical_a2a:enabled=auto at MIXED_FIGURES (flat and hierarchical all-to-alls in one
    program): outputs and every gradient bit for bit, and the point-to-point messages each sent."""
    model, (ids,) = load_model("gpt-moe-tiny", dtype=torch.float64, batch=8)
    local = (split_batch(ids, world_size, rank),)
    isend, sent = dist.isend, []

    def counting_isend(tensor, dst=None, *args, **kwargs):
        sent.append(dst)
        return isend(tensor, dst, *args, **kwargs)

    dist.isend = counting_isend
    runs = {}
    try:
        for name, passes in (("flat", "lift,expert_parallel"), ("auto", "lift,expert_parallel,hierarchical_a2a:enabled=auto")):
            plan = Plan.from_cli(passes, world_size=world_size, ranks_per_node=ranks_per_node, **MIXED_FIGURES)
            dm = distribute(copy.deepcopy(model), plan, local)
            sent.clear()
            dm.scheduler.stats.reset()
            out = dm(*local)
            probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=out.dtype)
            (out * probe).sum().backward()
            runs[name] = {
                "out": out.detach(), "grads": {n: p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None},
                "sites": dict(dm.program.runtime.a2a_sites), "p2p": len(sent),
                "inter": sum(dm.scheduler.stats.inter_node_bytes.values()),
            }
    finally:
        dist.isend = isend
    flat, auto = runs["flat"], runs["auto"]
    return {
        "out equal": _same(flat["out"], auto["out"]),
        "grads equal": sorted(flat["grads"]) == sorted(auto["grads"]) and all(_same(flat["grads"][n], auto["grads"][n]) for n in flat["grads"]),
        "grads": len(flat["grads"]),
        "sites": auto["sites"],
        "flat p2p": flat["p2p"], "auto p2p": auto["p2p"],
        "flat inter": flat["inter"], "auto inter": auto["inter"],
    }
