"""shard_states' sharded optimizer state under model-level names.

Under ZeRO (shard_states, stages 1 to 3) each rank's optimizer steps a flat range
[lo, hi) of each parameter it owns part of (`ShardedOptimizer._parts`); its moments are
1-D tensors of that range. A flat range of a tensor is a few boxes of it (`chunks.boxes`),
so each rank saves its moments as those chunks of `optimizer/<name>/<key>` at the
parameter's model-level shape (mapped through the parameter's own expert or tensor-parallel
sharding): the same names and shapes a replicated optimizer saves. A checkpoint saved at
one dp (or bucket size, or stage) loads at another, and on a plan without shard_states,
and back.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .chunks import Chunks, flat_chunks
from .state import OPTIMIZER, CheckpointError, layout_of


def _parts(dm, optimizer):
    """(name, parameter, lo, hi, the inner optimizer's flat view) of each part this rank steps."""
    names = {id(p): n for n, p in dm.module.named_parameters()}
    for param, _shard, _slot, lo, hi, view in optimizer._parts:
        name = names.get(id(param))
        if name is None:
            raise CheckpointError("the optimizer holds a parameter that is not the module's; build it with commfx.shard_optimizer(dm, ...)")
        if hi > lo:
            yield name, param, lo, hi, view


def sharded_optimizer_state(dm, optimizer, saved: dict | None = None) -> dict:
    """The sharded optimizer's state as DCP values (views of its flat moments). `saved`,
    when loading: the checkpoint's metadata, from which state not made yet is created."""
    layout = layout_of(dm)
    out = {}
    for name, param, lo, hi, view in _parts(dm, optimizer):
        state = optimizer.optimizer.state[view]
        if saved is not None and not state:
            state.update(_created(view, name, saved))
        sharding = layout.get(name)
        for key, value in state.items():
            fqn = f"{OPTIMIZER}{name}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                out[fqn] = value
            elif isinstance(value, torch.Tensor) and value.shape == view.shape:
                full = list(param.shape)
                if sharding is not None:
                    full[sharding.dim] = sharding.full
                where = None if sharding is None else (sharding.dim, sharding.indices, sharding.full)
                out[fqn] = Chunks(torch.Size(full), flat_chunks(value, tuple(param.shape), lo, where))
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} is neither a scalar nor shaped like its shard; commfx cannot save it "
                    "by name (use an optimizer whose state is shaped like its parameters, such as Adam, AdamW or SGD with momentum)"
                )
    return out


def _created(view: torch.Tensor, name: str, saved: dict) -> dict:
    prefix = f"{OPTIMIZER}{name}/"
    state = {}
    for fqn, md in saved.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            shape = () if len(md.size) == 0 else view.shape
            state[fqn[len(prefix):]] = torch.zeros(shape, dtype=md.properties.dtype)
    return state
