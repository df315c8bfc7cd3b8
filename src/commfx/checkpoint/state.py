"""A DistributedModule's state and its optimizer's, under model-level names.

Every parameter and buffer is saved under the name it has in the user's model with the
model's full shape: a replicated one as a plain tensor (DCP keeps one copy), a sharded one
as the `Chunks` this rank holds (`layout_of` says which entries of the full tensor those
are: a block of experts, a packed layer's experts in slot order, a tensor-parallel rank's
heads). Each optimizer state tensor shaped like its parameter is chunked the same way
(`optimizer/<name>/<key>`); scalar state (Adam's step) is saved as is. A module loads
whatever chunks its own layout needs, which is what makes the checkpoint reshardable.
A pipeline stage's graph module holds its parameters under the model's names (a stage is
cut from the captured model's graph), so a stage saves and loads the subset it holds; a
weight two stages hold (a tied embedding) is one replicated tensor, written once.

Runtime state that is the same on every rank (expert placements with routing statistics
summed over ranks, optimizer steps) is one object; what belongs to one rank (its RNG
state) is an object per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.tp import shard_index
from ..runtime.placement import RoutingStats, solve_slots
from .chunks import Chunks, chunks_of

MODEL, OPTIMIZER = "model/", "optimizer/"
RUNTIME = "commfx/runtime"
PARAM_GROUPS = "optimizer/param_groups"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: incomplete, corrupted, or of another model or plan."""


@dataclass(frozen=True)
class Sharding:
    """Which entries of the full tensor's `dim` this rank's tensor holds, in its order."""

    dim: int
    indices: list[int]
    full: int


def named_tensors(dm) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by their model-level names."""
    tensors = {**dict(dm.module.named_parameters()), **dict(dm.module.named_buffers())}
    return {name: t for name, t in tensors.items()}


def packed_layers(dm) -> dict:
    """op id -> placement of each packed layer (pack_experts; none in a pipeline stage)."""
    placements = getattr(dm, "placements", None)
    return placements.layers if placements is not None else {}


def layout_of(dm) -> dict[str, Sharding]:
    """Every sharded tensor's entries held here, from the shard specs, this rank's placement
    and (pack_experts) which expert each slot holds now."""
    packed = {target: layer for layer in packed_layers(dm).values() for target in layer.weights}
    out = {}
    for target, spec in dm.program.runtime.shards.items():
        if target not in dm.placement:
            continue  # another pipeline stage's
        local = dm.module.get_parameter(target).shape[spec["dim"]]
        where = dm.placement[target]
        if isinstance(where, dict):  # tensor_parallel: units of a (outer, units, inner) dim
            indices = shard_index(where["layout"], where["part"], where["parts"]).tolist()
            out[target] = Sharding(spec["dim"], indices, local * where["parts"])
        elif target in packed:  # slot s holds the expert e with slot_of[e] == s
            layer = packed[target]
            expert_at = torch.argsort(layer.slot_of).tolist()
            out[target] = Sharding(spec["dim"], [expert_at[s] for s in range(*where)], layer.num_experts)
        else:
            out[target] = Sharding(spec["dim"], list(range(*where)), local * spec["parts"])
    return out


def full_shapes(dm) -> dict[str, tuple[list[int], str]]:
    """name -> (the model's full shape, dtype) of every tensor of every rank (pipeline stages
    hold different ones): what identifies the model. Collective."""
    layout = layout_of(dm)
    mine = {}
    for name, tensor in named_tensors(dm).items():
        shape = list(tensor.shape)
        if name in layout:
            shape[layout[name].dim] = layout[name].full
        mine[name] = (shape, str(tensor.dtype).removeprefix("torch."))
    out = {}
    for held in dm.scheduler.all_gather_object(mine):
        out.update(held)
    return dict(sorted(out.items()))


def _view(tensor: torch.Tensor, sharding: Sharding | None):
    return tensor if sharding is None else chunks_of(tensor, sharding.dim, sharding.indices, sharding.full)


def model_state(dm) -> dict:
    """Parameters and buffers as DCP values (views of the live tensors)."""
    layout = layout_of(dm)
    return {MODEL + name: _view(t.detach(), layout.get(name)) for name, t in named_tensors(dm).items()}


def optimizer_state(dm, optimizer: torch.optim.Optimizer, saved: dict | None = None) -> dict:
    """The optimizer's state as DCP values, by parameter name and state key. `saved`, when
    loading: the checkpoint's metadata, from which state the optimizer has not made yet
    (Adam's moments before its first step) is created to be filled."""
    names = {id(p): n for n, p in dm.module.named_parameters()}
    layout = layout_of(dm)
    out = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise CheckpointError("the optimizer holds a parameter that is not the module's; build it over dm.parameters()")
            state = optimizer.state[param]
            if saved is not None and not state:
                state.update(_created_state(param, name, saved))
            for key, value in state.items():
                fqn = f"{OPTIMIZER}{name}/{key}"
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim():
                    out[fqn] = _view(value, layout.get(name))
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    out[fqn] = value
                elif isinstance(value, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither the parameter's "
                        f"{tuple(param.shape)} nor a scalar; commfx cannot save it by name (use an optimizer whose state "
                        "is shaped like its parameters, such as Adam, AdamW or SGD with momentum)"
                    )
                else:
                    out[fqn] = None if saved is not None else value  # a Python value: read back as an object
    return out


def optimizer_values(dm, optimizer: torch.optim.Optimizer, saved: dict | None = None) -> dict:
    """`optimizer_state`, or for shard_states' sharded optimizer its flat shards as chunks (zero.py)."""
    from ..runtime.sharded_optimizer import ShardedOptimizer

    if isinstance(optimizer, ShardedOptimizer):
        from .zero import sharded_optimizer_state  # imports this module

        return sharded_optimizer_state(dm, optimizer, saved)
    return optimizer_state(dm, optimizer, saved)


def _created_state(param: torch.Tensor, name: str, saved: dict) -> dict:
    """Zero state of the shapes and dtypes the checkpoint has for `name`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{OPTIMIZER}{name}/"
    state = {}
    for fqn, md in saved.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            state[fqn[len(prefix):]] = torch.zeros(md.size, dtype=dtype) if len(md.size) == 0 else torch.zeros_like(param, dtype=dtype)
    return state


def param_groups(dm, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's settings (lr, betas, ...) and its parameters' names, over every rank (a
    pipeline stage's optimizer holds its stage's parameters). Collective."""
    names = {id(p): n for n, p in dm.module.named_parameters()}
    mine = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    everyone = dm.scheduler.all_gather_object(mine)
    if len({len(groups) for groups in everyone}) > 1:
        raise CheckpointError("the ranks' optimizers have different numbers of parameter groups; build them alike on every rank")
    merged = [dict(group, params=list(group["params"])) for group in everyone[0]]
    for groups in everyone[1:]:
        for group, theirs in zip(merged, groups):
            group["params"] += [n for n in theirs["params"] if n not in group["params"]]
    return merged


def restore_param_groups(dm, optimizer: torch.optim.Optimizer, saved: list[dict], where: str) -> None:
    """Each group's saved settings back; this rank's groups must hold parameters of the
    matching saved groups (all of them, on every rank together). Collective."""
    mine = param_groups(dm, optimizer)
    if [sorted(g["params"]) for g in mine] != [sorted(g["params"]) for g in saved]:
        raise CheckpointError(
            f"{where}: the optimizer was saved with {len(saved)} parameter group(s) of other parameters than this one's "
            f"{len(mine)}; build the optimizer's groups as the saved run did"
        )
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


def runtime_state(dm) -> dict:
    """What is the same on every rank: expert placements (routing statistics summed over
    ranks, which is all a re-placement reads of them) and the optimizer steps counted."""
    layers = {}
    for op_id, layer in sorted(packed_layers(dm).items()):
        total = RoutingStats(layer.num_experts)
        for stats in dm.scheduler.all_gather_object(layer.stats.state_dict()):
            part = RoutingStats(layer.num_experts)
            part.load_state_dict(stats)
            total.merge(part)
        layers[op_id] = {"ranks": layer.ranks, "slot_of": layer.slot_of.tolist(), "replacements": layer.replacements, "stats": total.state_dict()}
    return {"expert_placement": layers, "optimizer_steps": getattr(dm, "optimizer_steps", 0)}


def restore_runtime(dm, state: dict) -> list[str]:
    """Placements and counters back into `dm`; the summed statistics on rank 0 (a re-placement
    sums them over ranks). A layer saved on another number of ranks gets a placement solved
    from its statistics for this one, starting from its saved slots. Returns what changed."""
    notes = []
    if hasattr(dm, "optimizer_steps"):
        dm.optimizer_steps = int(state["optimizer_steps"])
    for op_id, saved in state["expert_placement"].items():
        layer = packed_layers(dm).get(op_id)
        if layer is None:
            continue  # saved by a plan that packed this layer; here its experts are in expert order
        stats = RoutingStats(layer.num_experts)
        stats.load_state_dict(saved["stats"])
        slot_of = torch.tensor(saved["slot_of"], dtype=torch.int64)
        if saved["ranks"] != layer.ranks:
            balance = min((spec["balance"] for spec in dm.packing.values()), default=0.1)
            slot_of = solve_slots(stats, layer.ranks, slot_of, balance).slot_of
            notes.append(f"{op_id}: experts re-placed for {layer.ranks} ranks (saved on {saved['ranks']})")
        layer.slot_of = slot_of
        layer.replacements = int(saved["replacements"])
        layer.stats = stats if dm.scheduler.rank == 0 else RoutingStats(layer.num_experts)
    return notes
