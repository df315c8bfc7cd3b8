"""Functions the expert-move tests run on every rank (imported by the worker processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfx.plan import Topology
from commfx.runtime.comm import CommScheduler, build_groups
from commfx.runtime.expert_placement import MOVE_KIND, Placements, move_experts, plan_move

# Two packed layers, each with expert-stacked parameters (rows = this rank's experts).
SHAPES = {"w_in": (6, 5), "w_out": (5, 6), "bias": (5,)}
LAYERS = ("layers.0", "layers.1")


class Experts(torch.nn.Module):
    def __init__(self, per_rank: int, generator: torch.Generator):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(per_rank, *shape, generator=generator, dtype=torch.float64)))


def _full(tensor: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, expert e at row e (the single-process view of the stack)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)[slot_of]


def _snapshot(module, optimizer, placements) -> dict[str, torch.Tensor]:
    """Parameters and every optimizer state tensor, in expert order; scalar state as is."""
    out = {}
    for op_id, layer in placements.layers.items():
        for target in layer.weights:
            param = module.get_parameter(target)
            out[target] = _full(param.detach(), layer.slot_of)
            for key, value in optimizer.state[param].items():
                out[f"{target}/{key}"] = _full(value, layer.slot_of) if value.shape == param.shape else value.clone()
    return out


def move_against_reference(rank: int, world_size: int, seed: int = 0) -> dict:
    """AdamW-trained expert stacks on every rank, re-placed three times by `move_experts`:
    to a random placement, to the same placement (nothing may move), to a placement that
    only permutes rows inside ranks (nothing may be sent). After each, every rank's rows of
    parameters and optimizer state are compared bit for bit with the experts of the
    single-process view taken before, and the bytes counted are returned."""
    per_rank = 2
    experts = per_rank * world_size
    topology = Topology(world_size=world_size, ranks_per_node=1)
    scheduler = CommScheduler(topology, rank, build_groups(topology, rank), timeout_s=60)
    shared = torch.Generator().manual_seed(seed)  # the same placements on every rank
    mine = torch.Generator().manual_seed(1000 * seed + rank)  # this rank's weights and gradients
    module = torch.nn.ModuleDict({op_id.replace(".", "_"): Experts(per_rank, mine) for op_id in LAYERS})
    placements = Placements()
    for op_id in LAYERS:
        layer = placements.get(op_id, experts, world_size)
        layer.weights = [f"{op_id.replace('.', '_')}.{name}" for name in SHAPES]
        layer.slot_of = torch.randperm(experts, generator=shared)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for _ in range(2):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=mine, dtype=p.dtype)
        optimizer.step()

    def rank_moves(old, new):
        return int((old // per_rank != new // per_rank).sum())

    def within_ranks(slot_of):  # the same ranks, rows reversed inside each
        rank_of, row = slot_of // per_rank, slot_of % per_rank
        return rank_of * per_rank + (per_rank - 1 - row)

    results = []
    for label in ("random", "same", "within ranks"):
        before = _snapshot(module, optimizer, placements)
        new_slots = {}
        for op_id, layer in placements.layers.items():
            new_slots[op_id] = {"random": torch.randperm(experts, generator=shared), "same": layer.slot_of.clone(),
                                "within ranks": within_ranks(layer.slot_of)}[label]
        moves = [(layer, plan_move(layer.slot_of, new_slots[op_id], world_size, rank)) for op_id, layer in placements.layers.items()]
        moved = {op_id: rank_moves(layer.slot_of, new_slots[op_id]) for op_id, layer in placements.layers.items()}
        scheduler.stats.reset()
        move_experts([(layer, plan) for layer, plan in moves if not plan.unchanged], scheduler, module, optimizer)
        for op_id, layer in placements.layers.items():
            layer.slot_of = new_slots[op_id]
        after = _snapshot(module, optimizer, placements)
        stats = scheduler.stats.as_dict().get(MOVE_KIND, {"calls": 0, "intra_node_bytes": 0, "inter_node_bytes": 0})
        results.append({
            "label": label, "moved": moved, "calls": stats["calls"],
            "sent_bytes": stats["intra_node_bytes"] + stats["inter_node_bytes"],
            "unequal": sorted(k for k in before if not torch.equal(before[k], after[k])),
            "changed_rows": any(not plan.unchanged for _, plan in moves),
        })
    # The row bytes of one expert of one layer: every parameter's row, times (param + exp_avg + exp_avg_sq).
    row_bytes = sum(torch.Size(shape).numel() for shape in SHAPES.values()) * 8
    return {"results": results, "row_bytes": row_bytes, "state_tensors_per_param": 2}
