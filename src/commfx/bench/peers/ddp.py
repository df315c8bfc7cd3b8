"""Peer `ddp`: the whole model replicated on every rank under torch's DistributedDataParallel,
gradients averaged in DDP's buckets: what a user picks instead of expert parallelism (every
expert on every rank) or of `split_embedding_comm` (dense embedding gradients), and EmbRace's
baseline. Exact: the same function as the single-process model, checked in float64.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .common import CommRecord, PeerCheck, check_data_parallel, fastest_eager_experts, loss_and_backward

NAME = "ddp"
TOLERANCE = 1e-10  # float64, the same sums in another order
TOLERANCE_REASON = "float64; DDP sums the ranks' gradients in its own order"
BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's bucket_cap_mb default


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None) -> None:
    """DDP expresses any model; the model must fit on one rank, which nothing here can check."""


class DDPPeer:
    """The model under DDP on this rank (default bucket size, gradients averaged), stepped by
    torch's AdamW; `inputs` is this rank's share of the batch."""

    name = NAME
    tolerance = TOLERANCE

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0):
        self.inputs = inputs
        self.module = copy.deepcopy(model)
        fastest_eager_experts(self.module)
        self.ddp = self.called = DistributedDataParallel(self.module)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)

    def forward_backward(self) -> torch.Tensor:
        return loss_and_backward(self.module, self.ddp, self.inputs)

    def train_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward()
        self.optimizer.step()
        return loss

    def compute_only(self) -> torch.Tensor:
        """The same step without DDP's all-reduce (`no_sync`): each rank steps its own gradients."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.ddp.no_sync():
            loss = self.forward_backward()
        self.optimizer.step()
        return loss

    def step_bytes(self) -> dict[str, int]:
        """Payload bytes a step hands DDP's all-reduce: every trainable gradient, once."""
        return {"all_reduce": sum(r.nbytes for r in self.records)}

    @property
    def records(self) -> list[CommRecord]:
        """A step's all-reduces: the gradients in DDP's buckets (its default cap, 25 MiB)."""
        sizes = [p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad]
        buckets, current = [], 0
        for size in sizes:
            if current and current + size > BUCKET_BYTES:
                buckets.append(current)
                current = 0
            current += size
        buckets += [current] if current else []
        return [CommRecord("all_reduce", dist.get_world_size(), n) for n in buckets]


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          **_) -> PeerCheck:
    """DDP on this rank's share of `global_inputs` against the single-process model on the whole
    batch, in `dtype`: outputs, mean loss, averaged gradients and the AdamW step (collective)."""
    check_, _ = check_data_parallel(NAME, TOLERANCE, TOLERANCE_REASON, model, global_inputs, lr, dtype,
                                    lambda reference, inputs: DDPPeer(reference, inputs, ep_size=ep_size, lr=lr))
    check_.notes.append(f"the whole model on each of {dist.get_world_size()} ranks under DistributedDataParallel")
    return check_


Runner = DDPPeer  # the names every peer module gives the bench
