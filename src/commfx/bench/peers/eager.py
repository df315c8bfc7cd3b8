"""Peer `eager`: the plain model in one process, no commfx, trained with torch's AdamW on the
whole batch: the eager-PyTorch column of a compute table at world 1 (issue 42). Exact: the
same function as the single-process model, checked in float64.

The experts run as a user would run them eagerly (`fastest_eager_experts`, as every peer
does). It refuses a world of more than one rank: the plain model on each rank's share with
its gradients all-reduced is what `peer:ddp` already times, with DDP's overlapped buckets,
which is what a user runs; a second, slower version of it would only be a weaker baseline.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .common import CommRecord, PeerCheck, PeerUnsupported, fastest_eager_experts, loss_and_backward

NAME = "eager"
TOLERANCE = 1e-10  # float64; the experts' eager implementation sums in its own order
TOLERANCE_REASON = "float64; the model's own ops, experts as run eagerly"


def single_process(name: str, world_size: int) -> None:
    """Refuse a world of more than one rank (PeerUnsupported saying what to use instead)."""
    if world_size > 1:
        raise PeerUnsupported(
            f"peer:{name} is the plain model in one process (world 1: --nodes 1 --ranks-per-node 1); got a world of "
            f"{world_size} ranks. There the plain model on each rank's share with gradients all-reduced is peer:ddp")


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None) -> None:
    """Any model runs eagerly; only the world must be one rank."""
    single_process(NAME, world_size)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


class EagerPeer:
    """The model (a copy) called as it is, stepped by torch's AdamW; `inputs` is the whole batch.
    Subclasses change how the model is called (`wrap`)."""

    name = NAME
    tolerance = TOLERANCE
    tolerance_reason = TOLERANCE_REASON

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0):
        single_process(self.name, _world_size())
        self.inputs = inputs
        self.module = copy.deepcopy(model)
        fastest_eager_experts(self.module)
        self.called = self.wrap(self.module)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self.notes: list[str] = []  # lines the bench prints beside the peer's timings

    def wrap(self, module: nn.Module):
        """What the step calls: the module itself."""
        return module

    def forward_backward(self) -> torch.Tensor:
        return loss_and_backward(self.module, self.called, self.inputs)

    def train_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward()
        self.optimizer.step()
        return loss

    def compute_only(self) -> torch.Tensor:
        """The training step itself: one process issues no collectives."""
        return self.train_step()

    def step_bytes(self) -> dict[str, int]:
        return {}

    @property
    def records(self) -> list[CommRecord]:
        return []


CHECK_TOKENS = 32  # tokens per row the float64 check keeps of a batch of token ids


def first_tokens(inputs, tokens: int = CHECK_TOKENS):
    """A batch of token ids (every tensor 2-D integer, one shape) cut to its first `tokens`
    columns; any other batch as it is. A causal model computes the same function on a prefix,
    and the float64 reference's experts (HF's `batched_mm`: a copy of an expert's weights per
    routed token) need memory in proportion to the tokens."""
    from torch.utils import _pytree as pytree

    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    ids = leaves and all(t.dim() == 2 and not t.is_floating_point() and t.shape == leaves[0].shape for t in leaves)
    return pytree.tree_map(lambda t: t[:, :tokens] if isinstance(t, torch.Tensor) else t, inputs) if ids else inputs


def check_single(peer_class, model: nn.Module, global_inputs, *, lr: float, dtype: torch.dtype | None, **options) -> PeerCheck:
    """`peer_class` on the batch (token ids cut to their first CHECK_TOKENS) against the
    single-process model's step, in `dtype` (a process group of one rank must exist): outputs,
    loss and gradients at the peer's tolerance; its AdamW step against the model's initial
    parameters stepped by torch's AdamW from the peer's gradients, exactly."""
    from ...models.hf import choose_experts_implementation, training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call
    from .common import reference_step, relative_diff, score_forward, worst_over_ranks

    single_process(peer_class.name, _world_size())
    inputs = first_tokens(global_inputs)
    reference = copy.deepcopy(model).to(dtype) if dtype is not None else copy.deepcopy(model)
    choose_experts_implementation(reference)
    peer = peer_class(reference, inputs, ep_size=1, lr=lr, **options)
    ref = reference_step(reference, inputs, lr)
    peer.optimizer.zero_grad(set_to_none=True)
    with training_forward(peer.module):
        out = call(peer.called, inputs)
    loss = loss_fn(out, batch_tensors(inputs))
    loss.backward()
    check_ = PeerCheck(peer_class.name, peer_class.tolerance, peer_class.tolerance_reason, step_tolerance=1e-10)
    score_forward(check_, out, loss, ref)
    named = dict(peer.module.named_parameters())
    check_.grad_diffs = {n: relative_diff(p.grad, ref.grads[n]) for n, p in named.items()}
    stepped = {n: nn.Parameter(ref.initial[n].clone()) for n in named}
    for n, p in stepped.items():
        p.grad = named[n].grad.detach().clone()
    torch.optim.AdamW(stepped.values(), lr=lr).step()
    peer.optimizer.step()
    check_.step_diffs = {n: relative_diff(p, stepped[n]) for n, p in named.items()}
    check_.model_step_diffs = {n: relative_diff(p, ref.stepped[n]) for n, p in named.items()}
    worst_over_ranks(check_)
    return check_


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          **_) -> PeerCheck:
    """The eager model on the whole batch against the single-process model, in `dtype`."""
    check_ = check_single(EagerPeer, model, global_inputs, lr=lr, dtype=dtype)
    check_.notes.append("the plain model in one process, called eagerly")
    return check_


Runner = EagerPeer  # the names every peer module gives the bench
