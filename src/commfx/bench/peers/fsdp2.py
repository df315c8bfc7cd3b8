"""Peer `fsdp2`: the model under PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard` on each
layer of its layer list, then on the root, over a 1-D DeviceMesh of the whole world): what a
user picks to shard parameters, gradients and optimizer state (ZeRO-3), torchtitan's default.
Exact: the same function as the single-process model, checked in float64.

FSDP2's defaults throughout: each layer's parameters all-gathered before its forward and again
before its backward (`reshard_after_forward=True`; the root keeps its own unsharded between the
two), each group's gradients reduce-scattered and averaged, AdamW stepping the local shards.
Its collectives are counted from the parameter groups (each parameter padded along its first
dimension to a multiple of the world, as FSDP2 pads it): the link counters see the same bytes.
`compute_only` runs the same forward, backward and AdamW step on an unsharded copy of the
model (no all-gather, no reduce-scatter): for timing only.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .common import CommRecord, PeerCheck, PeerUnsupported, check_data_parallel, fastest_eager_experts, layer_list, loss_and_backward

NAME = "fsdp2"
TOLERANCE = 1e-10  # float64, the ranks' gradients summed in another order
TOLERANCE_REASON = "float64; FSDP2's reduce-scatter sums the ranks' gradients in its own order"


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None) -> None:
    """FSDP2 wraps any model with a layer list; sharding over one rank would be plain training."""
    if world_size < 2:
        raise PeerUnsupported("FSDP2 shards over the world: it needs at least 2 ranks")
    layer_list(model)


def shard(module: nn.Module) -> list[list[nn.Parameter]]:
    """`fully_shard` each layer, then the root; returns each FSDP group's parameters (layers
    first, the root's own last), as FSDP2 groups them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    path, _ = layer_list(module)
    layers = list(module.get_submodule(path))
    groups = [list(layer.parameters()) for layer in layers]
    inside = {id(p) for group in groups for p in group}
    groups.append([p for p in module.parameters() if id(p) not in inside])
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return groups


def group_records(groups: list[list[torch.Tensor]], world: int) -> list[CommRecord]:
    """A step's collectives: per layer group an all-gather in forward and again in backward, per
    root group one (kept unsharded between the two), per group a reduce-scatter of its gradients."""

    def padded(p: torch.Tensor) -> int:
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // world) * world * (p.numel() // max(rows, 1)) * p.element_size()

    records = []
    for index, group in enumerate(groups):
        full = sum(padded(p) for p in group)
        if not full:
            continue
        gathers = 1 if index == len(groups) - 1 else 2
        records += [CommRecord("all_gather", world, full // world)] * gathers
        records.append(CommRecord("reduce_scatter", world, full))
    return records


class FSDP2Peer:
    """The model under FSDP2 on this rank, stepped by torch's AdamW on its shards; `inputs` is
    this rank's share of the batch."""

    name = NAME
    tolerance = TOLERANCE

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0):
        self.inputs = inputs
        self.local = copy.deepcopy(model)  # compute_only's unsharded copy
        fastest_eager_experts(self.local)
        self.local_optimizer = torch.optim.AdamW(self.local.parameters(), lr=lr)
        self.module = self.called = copy.deepcopy(self.local)
        self.groups = shard(self.module)
        self.records = group_records(self.groups, dist.get_world_size())
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)

    def train_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_and_backward(self.module, self.module, self.inputs)
        self.optimizer.step()
        return loss

    def compute_only(self) -> torch.Tensor:
        """The same step on an unsharded copy: no all-gathers, no reduce-scatters."""
        self.local_optimizer.zero_grad(set_to_none=True)
        loss = loss_and_backward(self.local, self.local, self.inputs)
        self.local_optimizer.step()
        return loss

    def step_bytes(self) -> dict[str, int]:
        """Payload bytes a step hands FSDP2's collectives (all-gather: the local shards)."""
        kinds: dict[str, int] = {}
        for record in self.records:
            kinds[record.kind] = kinds.get(record.kind, 0) + record.nbytes
        return kinds


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          **_) -> PeerCheck:
    """FSDP2 on this rank's share of `global_inputs` against the single-process model on the
    whole batch, in `dtype`: outputs, mean loss, the full (gathered) averaged gradients and
    parameters after the AdamW step (collective)."""
    check_, peer = check_data_parallel(NAME, TOLERANCE, TOLERANCE_REASON, model, global_inputs, lr, dtype,
                                       lambda reference, inputs: FSDP2Peer(reference, inputs, ep_size=ep_size, lr=lr),
                                       full=lambda sharded: sharded.full_tensor())
    check_.notes.append(f"fully_shard on each of {len(peer.groups) - 1} layers and the root, over {dist.get_world_size()} ranks")
    return check_


Runner = FSDP2Peer  # the names every peer module gives the bench
