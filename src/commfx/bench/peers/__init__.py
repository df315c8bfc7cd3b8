"""Peers: the systems a user would pick instead of commfx, run in the same benchmark on the same
model, batch and optimizer (issue 29), each verified equal to the single-process model first.

- `deepspeed_moe` (:mod:`.deepspeed_moe`): the MoE blocks as DeepSpeed-MoE layers, trained
  through DeepSpeed's engine (Lina's baseline).
- `ddp` (:mod:`.ddp`): the whole model on every rank under DistributedDataParallel (the dense
  baseline: EmbRace's, and expert parallelism's without it).
- `fsdp2` (:mod:`.fsdp2`): every layer and the root under torch's FSDP2 `fully_shard`
  (parameters, gradients and AdamW state sharded over the world; ZeRO-3's peer).
- `pipelining` (:mod:`.pipelining`): the layers cut into one stage per rank by torch's
  `torch.distributed.pipelining` (1F1B or GPipe; Optimus-CC's baseline);
  `peer:pipelining:microbatches=4;schedule=gpipe`.
- `dtensor_tp` (:mod:`.dtensor_tp`): the attention and MLP blocks tensor-parallel with torch's
  DTensor `ColwiseParallel`/`RowwiseParallel`, the split commfx's tensor_parallel infers, the
  whole batch on every rank (ZERO-resizing's baseline; the bench runs it with `--tp WORLD`).
- `eager` (:mod:`.eager`) and `compile` (:mod:`.torch_compile`): the plain model in one process,
  called eagerly or through `torch.compile` (Inductor; `peer:compile:mode=...`): the compute
  table's columns at world 1 (`--nodes 1 --ranks-per-node 1`); at a larger world `ddp` is the peer.

Every peer module gives the bench `NAME`, `preflight(model, *, ep_size, world_size,
capacity_factor, inputs)` (one process, before any rank starts), `Runner(model, inputs, *, ep_size, lr,
capacity_factor)` (`train_step`, `compute_only`, `step_bytes`) and `check(model, global_inputs,
*, ep_size, lr)` (collective: a PeerCheck against the single-process model). The bench hands
a runner each step's batch by setting its `inputs` (a stream of batches); a peer that runs one
fixed batch says `FIXED_BATCH = True`. A peer with
options (`peer:NAME:key=value;key=value`) lists them with their defaults in `OPTIONS`; the
three functions then take them as keywords.

A peer that cannot express a model raises :class:`PeerUnsupported` (a ValueError) naming what.
Peer modules import their system lazily: importing this package needs none of them.
"""

import importlib
from types import ModuleType

from .common import PeerCheck, PeerUnsupported, relative_diff

# NAME in `--vs peer:NAME` -> the module that implements it.
PEERS = {"deepspeed_moe": "commfx.bench.peers.deepspeed_moe", "ddp": "commfx.bench.peers.ddp",
         "dtensor_tp": "commfx.bench.peers.dtensor_tp", "fsdp2": "commfx.bench.peers.fsdp2",
         "pipelining": "commfx.bench.peers.pipelining",
         "eager": "commfx.bench.peers.eager", "compile": "commfx.bench.peers.torch_compile"}


def peer_module(name: str) -> ModuleType:
    """The module of peer `name` (ValueError naming the known peers otherwise)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: the peers are {', '.join(sorted(PEERS))}")
    return importlib.import_module(PEERS[name])


def parse_peer(text: str) -> tuple[str, dict[str, str]]:
    """`NAME` or `NAME:key=value;key=value` -> (NAME, options), the options checked against the
    peer's `OPTIONS` (ValueError naming the known ones otherwise)."""
    from ...plan import PassSpec

    spec = PassSpec.parse(text)
    known = getattr(peer_module(spec.name), "OPTIONS", {})
    unknown = sorted(set(spec.options) - set(known))
    if unknown:
        offered = f"its options are {', '.join(sorted(known))}" if known else "it takes no options"
        raise ValueError(f"peer {spec.name} has no option {', '.join(unknown)}: {offered}")
    return spec.name, spec.options


__all__ = ["PEERS", "PeerCheck", "PeerUnsupported", "parse_peer", "peer_module", "relative_diff"]
