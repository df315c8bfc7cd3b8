"""Batches as the doors hand them around: a tuple of tensors or a dict of keyword tensors, cut
along dim 0 into ranks' shares, and called or stepped either way."""

from __future__ import annotations

import torch

from .plan import Plan


def split_batch(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    return torch.tensor_split(tensor, world_size, dim=0)[rank]


def batch_tensors(inputs) -> list[torch.Tensor]:
    """The tensors of a batch given as a tuple or as a dict of keyword tensors."""
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def call(model, inputs):
    """`model` on a batch: positionally for a tuple, by keyword for a dict."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def pipeline_step(pipeline, inputs, **options):
    """A pipeline module's `step` on a batch, passed as `call` passes it."""
    return pipeline.step(**inputs, **options) if isinstance(inputs, dict) else pipeline.step(*inputs, **options)


def data_share(plan: Plan, rank: int) -> tuple[int, int]:
    """(parts, index): the batch is cut over data-parallel replicas; the stages of one
    pipeline share their replica's part (with no pipeline, every rank is a replica)."""
    topology = plan.topology
    return topology.dp, topology.coordinates(rank)[1]


def local_batch(inputs, world_size: int, rank: int):
    """This rank's share of a global batch (a tuple of tensors or a dict of keyword tensors)."""
    if isinstance(inputs, dict):
        return {k: split_batch(t, world_size, rank) for k, t in inputs.items()}
    return tuple(split_batch(t, world_size, rank) for t in inputs)
