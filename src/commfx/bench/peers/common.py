"""What every peer shares: the refusal a peer raises for a model it cannot express, and the
check that a peer computes the single-process model's function before it is timed."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CommRecord:
    """One collective a peer issued in a step: kind, group size, payload bytes (the tensor handed
    in) and the group (None: the world), enough to replay it with a buffer of the same size; a
    point-to-point `send` or `recv` names its `peer` rank."""

    kind: str
    group_size: int
    nbytes: int
    group: Any = None
    peer: int = -1


def replay(records: list[CommRecord]) -> None:
    """A step's collectives again, alone, on buffers of their sizes (the peer's comm-only phase);
    a group of one rank sends nothing and is skipped. Sends and receives are all posted at once
    and then waited for (each pair of ranks matches them in order)."""
    import torch.distributed as dist

    p2p = [record for record in records if record.kind in ("send", "recv")]
    if p2p:
        operations = [dist.P2POp(dist.isend if r.kind == "send" else dist.irecv, torch.zeros(r.nbytes, dtype=torch.uint8), r.peer)
                      for r in p2p]
        for work in dist.batch_isend_irecv(operations):
            work.wait()
    for record in records:
        if record.group_size <= 1 or record.kind in ("send", "recv"):
            continue
        buffer = torch.zeros(record.nbytes, dtype=torch.uint8)
        if record.kind == "all_to_all":
            dist.all_to_all_single(torch.empty_like(buffer), buffer, group=record.group)
        elif record.kind == "all_gather":  # nbytes: the shard handed in
            dist.all_gather_into_tensor(buffer.new_empty(record.nbytes * record.group_size), buffer, group=record.group)
        elif record.kind == "reduce_scatter":  # nbytes: the whole tensor handed in
            buffer = buffer[: record.nbytes - record.nbytes % record.group_size]
            dist.reduce_scatter_tensor(buffer.new_empty(buffer.numel() // record.group_size), buffer, group=record.group)
        else:
            dist.all_reduce(buffer, group=record.group)


class PeerUnsupported(ValueError):
    """The peer cannot express this model or option; the message names what and why."""


def fastest_eager_experts(model: torch.nn.Module) -> None:
    """Built-in gpt-moe experts as a user would run them eagerly (`models.gpt_moe.grouped_experts`);
    an HF model's are chosen by `choose_experts_implementation`."""
    from ...models.gpt_moe import grouped_experts

    grouped_experts(model)


def layer_list(model: torch.nn.Module) -> tuple[str, int]:
    """(path, length) of the model's longest ModuleList: the repeated layers a pipeline cuts and
    FSDP wraps one by one."""
    lists = [(name, len(m)) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise PeerUnsupported("the model has no list of layers (an nn.ModuleList) to cut or wrap")
    return max(lists, key=lambda item: item[1])


@dataclass
class PeerCheck:
    """A peer against the single-process model on the same global batch, over one training step.

    Every figure is a difference relative to the reference tensor's largest entry
    (max |peer - reference| / max |reference|), the maximum over ranks:

    - `output_diff`, `loss_diff`, `grad_diffs` (gradients after the peer's own reduction):
      against the model on the whole batch, judged at `tolerance` (`tolerance_reason` says why:
      exact float64, or a part the peer computes in float32);
    - `step_diffs`: each parameter after the peer's optimizer step against the model's initial
      parameter stepped by torch's AdamW (the same hyperparameters) from the peer's gradient,
      judged at `step_tolerance`: the peer applies the same optimizer to every parameter;
    - `model_step_diffs`: each parameter after the peer's step against the model's after its own
      step. Reported, and judged at `tolerance` only when the peer is exact (`tolerance` equals
      `step_tolerance`): AdamW's first step is lr * g / (|g| + eps), which turns a float32
      rounding of a gradient entry near zero into a larger change of its update.
    """

    peer: str
    tolerance: float
    tolerance_reason: str
    step_tolerance: float = 1e-10
    output_diff: float = 0.0
    loss_diff: float = 0.0
    grad_diffs: dict[str, float] = field(default_factory=dict)
    step_diffs: dict[str, float] = field(default_factory=dict)
    model_step_diffs: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """What is over its tolerance (NaN is never within one)."""
        bad = [f"output {self.output_diff:.3g}"] if not self.output_diff <= self.tolerance else []
        bad += [f"loss {self.loss_diff:.3g}"] if not self.loss_diff <= self.tolerance else []
        bad += [f"gradient of {n} {d:.3g}" for n, d in self.grad_diffs.items() if not d <= self.tolerance]
        bad += [f"{n} after the step {d:.3g}" for n, d in self.step_diffs.items() if not d <= self.step_tolerance]
        if self.tolerance <= self.step_tolerance:
            bad += [f"{n} against the model's step {d:.3g}" for n, d in self.model_step_diffs.items() if not d <= self.tolerance]
        return bad

    @property
    def ok(self) -> bool:
        return bool(self.grad_diffs) and bool(self.step_diffs) and not self.failures()

    def line(self) -> str:
        def worst(diffs: dict[str, float]) -> float:
            return max(diffs.values(), default=float("nan"))

        verdict = "equal" if self.ok else "NOT equal: " + ", ".join(self.failures()[:4])
        return (f"{self.peer}: {verdict} to the single-process model (output {self.output_diff:.2g}, loss {self.loss_diff:.2g}, "
                f"gradients {worst(self.grad_diffs):.2g}: tolerance {self.tolerance:.2g}, {self.tolerance_reason}; "
                f"optimizer step from those gradients {worst(self.step_diffs):.2g}: tolerance {self.step_tolerance:.2g}; "
                f"parameters against the model's own step {worst(self.model_step_diffs):.2g})")


def relative_diff(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| relative to reference's largest entry (absolute where it is 0)."""
    value, reference = value.detach().double(), reference.detach().double()
    if value.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(value.shape)} against the reference's {tuple(reference.shape)}")
    if reference.numel() == 0:
        return 0.0
    scale = reference.abs().max().item()
    diff = (value - reference).abs().max().item()
    return diff / scale if scale > 0 else diff


@dataclass
class Reference:
    """The single-process model's training step on the whole global batch: what a peer's
    check compares against (outputs, loss, gradients, parameters before and after AdamW)."""

    outputs: list[torch.Tensor]  # flat outputs with a batch dimension
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    stepped: dict[str, torch.Tensor]


def reference_step(model: torch.nn.Module, global_inputs, lr: float) -> Reference:
    """One forward, backward and torch AdamW step of `model` (changed in place) on the whole batch."""
    from torch.utils import _pytree as pytree

    from ...models.hf import training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call

    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    with training_forward(model):
        out = call(model, global_inputs)
    loss = loss_fn(out, batch_tensors(global_inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    outputs = [t.detach() for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    return Reference(outputs, loss.detach(), grads, initial, {n: p.detach().clone() for n, p in model.named_parameters()})


def worst_over_ranks(check: PeerCheck, extra: tuple[float, ...] = ()) -> tuple[float, ...]:
    """Every figure of `check` replaced by its maximum over the ranks (collective; NaN counts
    as infinite), so every rank judges every rank's; returns `extra` reduced the same way."""
    import torch.distributed as dist

    names = sorted(check.grad_diffs)
    per_name = [check.grad_diffs, check.step_diffs, check.model_step_diffs]
    figures = torch.tensor([check.output_diff, check.loss_diff, *extra, *[d[n] for d in per_name for n in names]],
                           dtype=torch.float64)
    figures = torch.nan_to_num(figures, nan=float("inf"))
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    check.output_diff, check.loss_diff = figures[0].item(), figures[1].item()
    rest = figures[2 + len(extra):].view(len(per_name), len(names)).tolist()
    check.grad_diffs, check.step_diffs, check.model_step_diffs = (dict(zip(names, row)) for row in rest)
    return tuple(figures[2:2 + len(extra)].tolist())


def score_forward(check: PeerCheck, outputs, loss: torch.Tensor, reference: Reference) -> None:
    """Set `check`'s output and loss figures: this rank's outputs against the reference's rows
    for this rank, and the mean of the ranks' losses against the reference loss (collective)."""
    import torch.distributed as dist
    from torch.utils import _pytree as pytree

    from ...verify import local_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [t for t in pytree.tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    theirs = [local_batch((t,), world, rank)[0] for t in reference.outputs]
    # A model that returns only its loss has no per-row output: the loss figure is the comparison.
    check.output_diff = max((relative_diff(a, b) for a, b in zip(mine, theirs, strict=True)), default=0.0 if not mine else float("nan"))
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    check.loss_diff = relative_diff(mean_loss / world, reference.loss)


def loss_and_backward(module: torch.nn.Module, called, inputs) -> torch.Tensor:
    """commfx's training loss of `called` (the module, or its wrapper) on `inputs`, backward
    run; returns the detached loss. An HF module builds no KV cache meanwhile."""
    from ...models.hf import training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call

    with training_forward(module):
        loss = loss_fn(call(called, inputs), batch_tensors(inputs))
    loss.backward()
    return loss.detach()


def check_data_parallel(name: str, tolerance: float, reason: str, model: torch.nn.Module, global_inputs, lr: float,
                        dtype: torch.dtype | None, build, full=lambda t: t) -> tuple[PeerCheck, Any]:
    """A data-parallel peer (`build(reference, inputs)` -> a runner with `.module`, `.called` and
    `.optimizer`) on this rank's share of `global_inputs` against the single-process model on
    the whole batch, in `dtype`: outputs, mean loss, averaged gradients and the AdamW step, each
    tensor read through `full` (a sharded peer's gather). Collective; returns (check, runner)."""
    import torch.distributed as dist

    from ...models.hf import choose_experts_implementation, training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call, local_batch

    reference = copy.deepcopy(model).to(dtype) if dtype is not None else copy.deepcopy(model)
    choose_experts_implementation(reference)
    inputs = local_batch(global_inputs, dist.get_world_size(), dist.get_rank())
    peer = build(reference, inputs)
    ref = reference_step(reference, global_inputs, lr)
    with training_forward(peer.module):
        out = call(peer.called, inputs)
    loss = loss_fn(out, batch_tensors(inputs))
    loss.backward()
    check = PeerCheck(name, tolerance, reason, step_tolerance=tolerance)
    score_forward(check, out, loss, ref)
    named = dict(peer.module.named_parameters())
    check.grad_diffs = {n: relative_diff(full(p.grad), ref.grads[n]) for n, p in named.items()}
    peer.optimizer.step()
    check.step_diffs = {n: relative_diff(full(p), ref.stepped[n]) for n, p in named.items()}
    check.model_step_diffs = dict(check.step_diffs)
    worst_over_ranks(check)
    return check, peer

