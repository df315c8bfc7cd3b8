"""Functions the LocMoE tests run on every rank (imported by the worker processes)."""

from __future__ import annotations

import torch

from commfx.plan import Topology
from commfx.runtime.comm import CommScheduler, build_groups

BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _cases(rank: int, world_size: int):
    """(name, rows, send_rows) per case; every rank builds its own part of each case."""
    g = torch.Generator().manual_seed(100 + rank)
    cases = []
    # MoE dispatch: tokens copied once per chosen rank (several ranks of a remote node), uneven
    tokens = torch.randn(12 + rank, 16, dtype=torch.float64, generator=g)
    picks = [torch.randperm(world_size, generator=g)[: 1 + (t % 3)].sort().values for t in range(tokens.shape[0])]
    send = [sum(int((p == d).any()) for p in picks) for d in range(world_size)]
    rows = torch.cat([tokens[[t for t, p in enumerate(picks) if (p == d).any()]] for d in range(world_size)])
    cases.append(("dispatch float64", rows, send))
    # distinct rows, empty splits: rank 1 sends nothing at all, rank 2 nothing to rank 0
    send = [0 if rank == 1 or (rank == 2 and d == 0) else (rank + d) % 3 + 1 for d in range(world_size)]
    cases.append(("uneven and empty", torch.randn(sum(send), 2, 2, generator=g, dtype=torch.float64), send))
    # nothing anywhere
    cases.append(("all empty", torch.zeros(0, 4, dtype=torch.float64), [0] * world_size))
    # bits, not values: -0.0 and 0.0 differ, NaN equals NaN; float32
    special = torch.tensor([[0.0, 1.0], [-0.0, 1.0], [float("nan"), 2.0], [float("nan"), 2.0]])
    cases.append(("signed zero and nan", special.repeat(world_size, 1), [4] * world_size))
    # integer rows (the count exchange) and rows of one value each
    counts = torch.arange(world_size * 2, dtype=torch.int64).reshape(world_size, 2) + rank
    cases.append(("int64 counts", counts, [1] * world_size))
    return cases


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BIT_VIEWS[t.element_size()])


def hierarchical_vs_flat(rank: int, world_size: int, ranks_per_node: int) -> dict:
    topology = Topology(world_size=world_size, ranks_per_node=ranks_per_node)
    scheduler = CommScheduler(topology, rank, build_groups(topology, rank), timeout_s=60)
    cases = _cases(rank, world_size)
    all_recv = {}
    ones = [1] * world_size
    for name, rows, send in cases:
        gathered = scheduler.all_to_all(torch.tensor([send], dtype=torch.int64).repeat(world_size, 1), ones, ones, "ep")
        all_recv[name] = gathered[:, rank].tolist()
    results = {}
    for name, rows, send in cases:
        recv = all_recv[name]
        out = {}
        for algorithm in ("flat", "hierarchical"):
            scheduler.a2a_algorithm = algorithm
            scheduler.stats.reset()
            out[algorithm] = scheduler.all_to_all(rows, send, recv, "ep")
            out[algorithm + " inter"] = sum(scheduler.stats.inter_node_bytes.values())
            out[algorithm + " intra"] = sum(scheduler.stats.intra_node_bytes.values())
        flat, hier = out["flat"], out["hierarchical"]
        results[name] = {
            "equal": flat.shape == hier.shape and flat.dtype == hier.dtype and torch.equal(_bits(flat), _bits(hier)),
            "rows": flat.shape[0],
            "flat_inter": out["flat inter"],
            "hier_inter": out["hierarchical inter"],
        }
    return results
