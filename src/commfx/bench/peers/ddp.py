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

from .common import CommRecord, PeerCheck, fastest_eager_experts, loss_and_backward, reference_step, relative_diff, score_forward, worst_over_ranks

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
        self.ddp = DistributedDataParallel(self.module)
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

    from ...models.hf import choose_experts_implementation, training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call, local_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = copy.deepcopy(model).to(dtype) if dtype is not None else copy.deepcopy(model)
    choose_experts_implementation(reference)
    inputs = local_batch(global_inputs, world, rank)
    peer = DDPPeer(reference, inputs, ep_size=ep_size, lr=lr)
    ref = reference_step(reference, global_inputs, lr)

    with training_forward(peer.module):
        out = call(peer.ddp, inputs)
    loss = loss_fn(out, batch_tensors(inputs))
    loss.backward()
    check_ = PeerCheck(NAME, TOLERANCE, TOLERANCE_REASON, step_tolerance=TOLERANCE)
    score_forward(check_, out, loss, ref)
    named = dict(peer.module.named_parameters())
    check_.grad_diffs = {n: relative_diff(p.grad, ref.grads[n]) for n, p in named.items()}
    peer.optimizer.step()
    check_.step_diffs = {n: relative_diff(p, ref.stepped[n]) for n, p in named.items()}
    check_.model_step_diffs = dict(check_.step_diffs)
    worst_over_ranks(check_)
    check_.notes.append(f"the whole model on each of {world} ranks under DistributedDataParallel")
    return check_


Runner = DDPPeer  # the names every peer module gives the bench
