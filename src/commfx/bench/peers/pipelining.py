"""Peer `pipelining`: the model cut into pipeline stages and trained by PyTorch's own
`torch.distributed.pipelining` (its tracing frontend `pipeline()` with a split point before
each stage's first layer, `PipelineStage`, `Schedule1F1B` or `ScheduleGPipe`): what a user picks
instead of commfx's `pipeline_split`, and Optimus-CC's baseline (an uncompressed pipeline).
Exact: the same function as the single-process model, checked in float64.

The built-in gpt-moe is cut by hand (:class:`GPTMoEStage`, so its experts run eagerly as a
user's would); other models are traced. The cut is commfx's `pipeline_split:balance=layers`: the model's layer list (the longest
`ModuleList`) dealt out in contiguous blocks of nearly equal size, what comes before the
first layer in the first stage, the final norm, head and loss in the last. Every rank is one
stage (pp = world, no data parallelism): the first stage reads the whole batch, cut into
micro-batches, and the last stage computes commfx's training loss on each (next-token cross
entropy), torch's schedule averaging the micro-batches' gradients.

The activations and activation gradients a step sends between stages are the P2P operations
the schedule asks the stage for; the peer keeps them as :class:`CommRecord`\\ s (the link
counters see the same bytes). `compute_only` runs the same schedule with those operations
left out: each stage computes on the buffers its last real step received (same shapes, no
communication, no waiting on a neighbour): for timing only.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from ...models.gpt_moe import GPTMoE
from .common import CommRecord, PeerCheck, PeerUnsupported, Reference, fastest_eager_experts, layer_list, reference_step, relative_diff, worst_over_ranks

NAME = "pipelining"
WHOLE_BATCH = True  # every rank is one stage: the first reads the whole batch
FIXED_BATCH = True  # its schedule is built around one batch: no stream of batches (commfx bench --batches)
OPTIONS = {"microbatches": 0, "schedule": "1f1b"}  # 0: as many micro-batches as stages (commfx's default)
SCHEDULES = ("1f1b", "gpipe")
TOLERANCE = 1e-10  # float64, the micro-batches' gradients summed in another order
TOLERANCE_REASON = "float64; the schedule sums the micro-batches' gradients in its own order"
_STAGE_OPS = ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops", "get_bwd_recv_ops")


def split_points(model: nn.Module, stages: int) -> dict[str, object]:
    """`pipeline()`'s split_spec: a split before the first layer of every stage after the first,
    the layers dealt out as commfx's `pipeline_split:balance=layers` deals them."""
    from torch.distributed.pipelining import SplitPoint

    from ...passes.pipeline_split import balance_by_count

    path, count = layer_list(model)
    if count < stages:
        raise PeerUnsupported(f"{path} has {count} layers, fewer than the {stages} pipeline stages")
    stage_of = balance_by_count(count, stages)
    firsts = [min(layer for layer, s in stage_of.items() if s == stage) for stage in range(1, stages)]
    return {f"{path}.{layer}": SplitPoint.BEGINNING for layer in firsts}


class GPTMoEStage(nn.Module):
    """Stage `index` of `stages` of the built-in gpt-moe, cut by hand as torchtitan cuts its
    models (the layers of other stages dropped, the parameters under their model names) rather
    than traced by `pipeline()`: a trace would fix the experts' capturable per-row form, this
    stage runs them eagerly as a user would (grouped over the routed rows)."""

    def __init__(self, model: GPTMoE, index: int, stages: int):
        super().__init__()
        from ...passes.pipeline_split import balance_by_count

        self.first, self.last = index == 0, index == stages - 1
        stage_of = balance_by_count(len(model.layers), stages)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers) if stage_of[i] == index})
        self.embed, self.pos = (model.embed, model.pos) if self.first else (None, None)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if self.last else (None, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.embed(h) + self.pos(torch.arange(h.shape[1], device=h.device))
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.ln_f(h)) if self.last else h


def _options(world_size: int, microbatches: int | str = 0, schedule: str = "1f1b") -> tuple[int, str]:
    microbatches = int(microbatches) or world_size
    if schedule not in SCHEDULES:
        raise PeerUnsupported(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if microbatches < world_size and schedule == "1f1b":
        raise PeerUnsupported(f"1F1B needs at least as many micro-batches as stages ({world_size}); got {microbatches}")
    return microbatches, schedule


def _ids(inputs) -> torch.Tensor:
    """The batch's one tensor of token ids (the only input form the peer cuts into micro-batches)."""
    tensors = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    if len(tensors) != 1 or tensors[0].is_floating_point():
        raise PeerUnsupported("the pipelining peer takes models called with one tensor of token ids "
                              f"(this batch has {len(tensors)} tensors)")
    return tensors[0]


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None,
              **options) -> None:
    """What the peer refuses before any rank starts: a world of one, options it does not know,
    a model without enough layers or called with more than ids."""
    if world_size < 2:
        raise PeerUnsupported("a pipeline needs at least 2 ranks (one stage each)")
    microbatches, _ = _options(world_size, **options)
    split_points(model, world_size)
    if inputs is not None and _ids(inputs).shape[0] % microbatches:
        raise PeerUnsupported(f"the batch of {_ids(inputs).shape[0]} rows does not split into {microbatches} micro-batches")


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """commfx's training loss on one micro-batch (train.loss_fn: next-token cross entropy)."""
    from ...train import loss_fn

    return loss_fn(logits, (ids,))


class PipeliningPeer:
    """This rank's stage of the model under torch.distributed.pipelining, stepped by AdamW;
    `inputs` is the whole batch (the first stage feeds it, the last reads its targets)."""

    name = NAME
    tolerance = TOLERANCE

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0, **options):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, pipeline

        from ...models.hf import training_forward

        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.microbatches, schedule = _options(world, **options)
        self.ids = _ids(inputs)
        model = copy.deepcopy(model)
        fastest_eager_experts(model)
        if isinstance(model, GPTMoE):
            self.stage = PipelineStage(GPTMoEStage(model, self.rank, world), self.rank, world, torch.device("cpu"))
        else:
            micro = self.ids[: self.ids.shape[0] // self.microbatches]
            with training_forward(model):
                pipe = pipeline(model, mb_args=(micro,), split_spec=split_points(model, world))
            self.stage = pipe.build_stage(self.rank, torch.device("cpu"))
        self.module = self.stage.submod
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.schedule = kind(self.stage, n_microbatches=self.microbatches, loss_fn=_loss)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self.records: list[CommRecord] = []
        self._step_records: list[CommRecord] = []
        self._local_only = False
        for method in _STAGE_OPS:
            setattr(self.stage, method, self._recorded(getattr(self.stage, method)))

    def _recorded(self, get_ops):
        """The stage's P2P operations, each kept as a record; none at all in compute-only steps."""

        def ops(chunk_id: int):
            if self._local_only:
                return []
            found = get_ops(chunk_id)
            for op in found:
                kind = "send" if op.op in (dist.isend, dist.send) else "recv"
                self._step_records.append(CommRecord(kind, 2, op.tensor.numel() * op.tensor.element_size(), peer=op.peer))
            return found

        return ops

    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward and backward of every micro-batch: (mean loss on the last stage, else 0;
        the last stage's merged output, else None)."""
        losses: list[torch.Tensor] = []
        if self.stage.is_first:
            output = self.schedule.step(self.ids)
        else:
            output = self.schedule.step(target=self.ids, losses=losses)
        loss = torch.stack([loss.detach() for loss in losses]).mean() if losses else torch.zeros((), dtype=torch.float64)
        return loss, output if self.stage.is_last else None

    def train_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        self._step_records = []
        loss, _ = self.run()
        self.optimizer.step()
        self.records = self._step_records
        return loss

    def compute_only(self) -> torch.Tensor:
        """The same schedule with no sends or receives (the buffers keep the last real step's values)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._local_only = True
        try:
            loss, _ = self.run()
        finally:
            self._local_only = False
        self.optimizer.step()
        return loss

    def step_bytes(self) -> dict[str, int]:
        """Payload bytes this stage sends a step: activations forward, their gradients back."""
        return {"p2p": sum(r.nbytes for r in self.records if r.kind == "send")}


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          **options) -> PeerCheck:
    """The pipeline on `global_inputs` against the single-process model, in `dtype`: the last
    stage's output and mean loss, every stage's gradients and the AdamW step (collective)."""
    from ...models.hf import choose_experts_implementation

    reference = copy.deepcopy(model).to(dtype) if dtype is not None else copy.deepcopy(model)
    choose_experts_implementation(reference)
    peer = PipeliningPeer(reference, global_inputs, ep_size=ep_size, lr=lr, **options)
    ref = reference_step(reference, global_inputs, lr)
    loss, output = peer.run()
    check_ = PeerCheck(NAME, TOLERANCE, TOLERANCE_REASON, step_tolerance=TOLERANCE)
    _score_stages(check_, peer, loss, output, ref)
    check_.notes.append(f"{dist.get_world_size()} stages under torch.distributed.pipelining, {peer.microbatches} micro-batches")
    return check_


def _score_stages(check_: PeerCheck, peer: PipeliningPeer, loss: torch.Tensor, output, ref: Reference) -> None:
    """Fill `check_`: output and loss on the last stage, each stage's own parameters, a parameter
    no stage holds a failure (collective)."""
    named = dict(peer.module.named_parameters())
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, set(named))
    owned = set().union(*held)
    missing = sorted(set(ref.grads) - owned)
    if peer.stage.is_last:
        check_.output_diff = relative_diff(output, ref.outputs[0])
        check_.loss_diff = relative_diff(loss, ref.loss)
    check_.grad_diffs = {n: relative_diff(named[n].grad, ref.grads[n]) if n in named else 0.0 for n in ref.grads}
    peer.optimizer.step()
    check_.step_diffs = {n: relative_diff(named[n], ref.stepped[n]) if n in named else 0.0 for n in ref.grads}
    check_.model_step_diffs = dict(check_.step_diffs)
    for name in missing:  # held by no stage: never trained
        check_.grad_diffs[name] = float("inf")
    worst_over_ranks(check_)


Runner = PipeliningPeer  # the names every peer module gives the bench
