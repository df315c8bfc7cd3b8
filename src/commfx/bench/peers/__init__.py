"""Peers: the systems a user would pick instead of commfx, run in the same benchmark on the same
model, batch and optimizer (issue 29), each verified equal to the single-process model first.

- `deepspeed_moe` (:mod:`.deepspeed_moe`): the MoE blocks as DeepSpeed-MoE layers, trained
  through DeepSpeed's engine (Lina's baseline).

A peer that cannot express a model raises :class:`PeerUnsupported` (a ValueError) naming what.
Peer modules import their system lazily: importing this package needs none of them.
"""

from .common import PeerCheck, PeerUnsupported, relative_diff

__all__ = ["PeerCheck", "PeerUnsupported", "relative_diff"]
