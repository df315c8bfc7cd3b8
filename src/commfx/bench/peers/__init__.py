"""Peers: the systems a user would pick instead of commfx, run in the same benchmark on the same
model, batch and optimizer (issue 29), each verified equal to the single-process model first.

- `deepspeed_moe` (:mod:`.deepspeed_moe`): the MoE blocks as DeepSpeed-MoE layers, trained
  through DeepSpeed's engine (Lina's baseline).
- `ddp` (:mod:`.ddp`): the whole model on every rank under DistributedDataParallel (the dense
  baseline: EmbRace's, and expert parallelism's without it).
- `dtensor_tp` (:mod:`.dtensor_tp`): the attention and MLP blocks tensor-parallel with torch's
  DTensor `ColwiseParallel`/`RowwiseParallel`, the split commfx's tensor_parallel infers, the
  whole batch on every rank (ZERO-resizing's baseline; the bench runs it with `--tp WORLD`).

Every peer module gives the bench `NAME`, `preflight(model, *, ep_size, world_size,
capacity_factor, inputs)` (one process, before any rank starts), `Runner(model, inputs, *, ep_size, lr,
capacity_factor)` (`train_step`, `compute_only`, `step_bytes`) and `check(model, global_inputs,
*, ep_size, lr)` (collective: a PeerCheck against the single-process model).

A peer that cannot express a model raises :class:`PeerUnsupported` (a ValueError) naming what.
Peer modules import their system lazily: importing this package needs none of them.
"""

import importlib
from types import ModuleType

from .common import PeerCheck, PeerUnsupported, relative_diff

# NAME in `--vs peer:NAME` -> the module that implements it.
PEERS = {"deepspeed_moe": "commfx.bench.peers.deepspeed_moe", "ddp": "commfx.bench.peers.ddp",
         "dtensor_tp": "commfx.bench.peers.dtensor_tp"}


def peer_module(name: str) -> ModuleType:
    """The module of peer `name` (ValueError naming the known peers otherwise)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: the peers are {', '.join(sorted(PEERS))}")
    return importlib.import_module(PEERS[name])


__all__ = ["PEERS", "PeerCheck", "PeerUnsupported", "peer_module", "relative_diff"]
