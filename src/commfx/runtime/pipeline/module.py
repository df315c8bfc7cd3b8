"""The per-rank module of a pipeline: one stage, run over micro-batches by a schedule.

This rank holds only its stage's graph and parameters. `step(inputs, loss_fn)` cuts this
rank's batch into micro-batches and runs the schedule's actions: a forward receives the
boundary from the previous stage (tensors become leaves that require grad where a
gradient goes back), runs the stage (lowered once per input signature by the compile
function it was given: aot_autograd forward and backward) and sends its boundary on; the
last stage applies `loss_fn`. A backward receives the gradients of what this stage sent,
backpropagates, and sends the gradients of what it received. Values a later stage needs
are forwarded untouched (their gradients add to this stage's own).

The runtime knows nothing about what a boundary's backward payload means: a boundary
`codec` (set by a pass, e.g. compress_pipeline) turns gradients into a payload and back,
with state that lives here, keyed by boundary, and is saved in `state_dict`.

Point-to-point transfers go through the comm scheduler in the `pp` priority class, one
lane per direction (sends never wait behind receives; each lane keeps micro-batch order,
which both ends share). Shapes travel once per input signature, ahead of the first
forward transfer. After the schedule, parameter gradients (accumulated over micro-batches)
are reduced over the data-parallel group; a weight held by the first and last stage (a
tied embedding) is also summed across them, or in one fused all-reduce if the pipeline
asks for it. A stage with a `dp_codec` (compress_pipeline:dp_stages) hands the gradients
the codec compresses to it instead; the rest reduce as usual.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ...plan import Plan
from ..comm import CommScheduler, install_default
from ..executor import GraphExecutor
from ..grad_sync import GradientSync, Slot
from ..state_shards import ShardedGradSync
from ..module import graph_inputs
from .schedule import actions, critical_backwards

INPUT_PREFIX = "input:"
PP = "pp"


class StagedModel(Protocol):
    """What the runtime needs of a split program (the compiler's Program, its
    `regions.pipeline` a compiler.stages.Pipeline)."""

    out_spec: pytree.TreeSpec
    regions: Any
    runtime: Any
    input_names: list[str]
    signature: inspect.Signature | None


@dataclass
class Microbatch:
    """What `loss_fn` gets besides the outputs: the micro-batch's model inputs (in the
    order the model was captured with) and its index and rows in this rank's batch."""

    index: int
    inputs: tuple[torch.Tensor, ...]
    rows: slice


@dataclass
class StepResult:
    loss: torch.Tensor | None  # the micro-batch losses combined as their gradients were (last stage only)
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # per micro-batch, the model's outputs (last stage only)


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward."""

    leaves: dict[str, torch.Tensor]  # received values (leaves)
    sent: dict[str, torch.Tensor]  # values sent on, as computed here (autograd graph attached)
    loss: torch.Tensor | None = None


class PipelineModule(torch.nn.Module):
    def __init__(self, program: StagedModel, plan: Plan, scheduler: CommScheduler, placement: dict, compile_training: Callable):
        super().__init__()
        self.program = program
        self.plan = plan
        self.scheduler = scheduler
        self.placement = placement
        self._compile_training = compile_training
        install_default(scheduler)
        pipeline = program.regions.pipeline
        self.pipeline = pipeline
        self.stage_index, self.dp_index, _ = plan.topology.coordinates(scheduler.rank)
        self.stage = pipeline.stages[self.stage_index]
        self.module = self.stage.gm  # this stage's parameters only
        self.num_stages = len(pipeline.stages)
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        self.recv_boundary = pipeline.boundaries[self.stage_index - 1] if not self.is_first else None
        self.send_boundary = pipeline.boundaries[self.stage_index] if not self.is_last else None
        self.codec_state: dict[int, dict[str, torch.Tensor]] = {}  # boundary index -> the codec's state
        self.dp_codec_state: dict[str, torch.Tensor] = {}  # the stage's dp codec state (Q and residuals)
        self.grad_sync, self.shared_sync = self._gradient_syncs()
        self._compiled: dict[tuple, Callable] = {}
        self._shapes: dict[tuple, list[torch.Size]] = {}  # (input signature) -> shapes of the received boundary
        self._pending_sends: list = []
        self.timeline = None

    # -- the step ---------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipeline stage runs forward and backward together over micro-batches: call "
            "module.step(*inputs, loss_fn=fn) (fn(outputs, microbatch) -> scalar loss) instead of module(...)"
        )

    def step(self, *args, loss_fn: Callable, scale_grads: bool = True, **kwargs) -> StepResult:
        """Run one training step's forward and backward over this rank's batch.

        Gradients accumulate into the parameters' `.grad` (zero them each step, as with DDP)
        and are reduced over data-parallel replicas. `scale_grads` divides each micro-batch
        loss by the number of micro-batches (torch.distributed.pipelining's default), so a
        mean loss gives the gradient of the mean over the whole batch.
        """
        inputs = graph_inputs(self.program, args, kwargs, "Re-capture for new inputs is not supported with pipeline_split yet")
        self.synchronize()  # shard_states:stage=3: this stage's buckets gathered once for every micro-batch
        microbatches = self._cut(inputs)
        count = len(microbatches)
        scale = 1.0 / count if scale_grads else 1.0
        schedule = self.pipeline.schedule
        critical_sends = critical_backwards(schedule, self.stage_index, self.num_stages, count)
        critical_recvs = critical_backwards(schedule, self.stage_index + 1, self.num_stages, count) if not self.is_last else set()
        result = StepResult(loss=None)
        flight: dict[int, _InFlight] = {}
        signature = tuple((tuple(t.shape), t.dtype) for t in microbatches[0].inputs)
        try:
            for action in actions(schedule, self.stage_index, self.num_stages, count):
                mb = microbatches[action.microbatch]
                if action.kind == "F":
                    flight[mb.index] = self._forward(mb, signature, loss_fn, result)
                else:
                    self._backward(mb, flight.pop(mb.index), scale, mb.index in critical_recvs, mb.index in critical_sends)
            for pending in self._pending_sends:
                self.scheduler.wait(pending)
        finally:
            self._pending_sends = []
        self._reduce_gradients()
        if self.is_last:
            losses = torch.stack([loss.detach() for loss in result.losses])
            result.loss = losses.mean() if scale_grads else losses.sum()
        return result

    def _cut(self, inputs: tuple[torch.Tensor, ...]) -> list[Microbatch]:
        count = self.pipeline.microbatches
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else 0
        if rows == 0 or rows % count:
            raise ValueError(
                f"this rank's batch has {rows} rows, which do not cut into {count} equal micro-batches "
                f"(pipeline_split:microbatches={count}); use a batch per data-parallel rank that {count} divides"
            )
        size = rows // count
        return [
            Microbatch(i, tuple(t[i * size : (i + 1) * size] for t in inputs), slice(i * size, (i + 1) * size))
            for i in range(count)
        ]

    def _forward(self, mb: Microbatch, signature: tuple, loss_fn: Callable, result: StepResult) -> _InFlight:
        env = {INPUT_PREFIX + name: t for name, t in zip(self.program.input_names, mb.inputs)}
        leaves: dict[str, torch.Tensor] = {}
        if self.recv_boundary is not None:
            received = self._recv_activations(signature, mb.index)
            for spec, tensor in zip(self.recv_boundary.tensors, received):
                leaves[spec.name] = tensor.requires_grad_(spec.requires_grad)
            env.update(leaves)
        stage_inputs = [env[name] for name in self.stage.inputs]
        outputs = self._compiled_stage(stage_inputs)(*stage_inputs)
        env.update(zip(self.stage.outputs, outputs))
        flight = _InFlight(leaves, {})
        if self.send_boundary is not None:
            flight.sent = {name: env[name] for name in self.send_boundary.names}
            self._send_activations(signature, [env[name] for name in self.send_boundary.names], mb.index)
        else:
            model_outputs = pytree.tree_unflatten([env[name] for name in self.pipeline.model_outputs], self.program.out_spec)
            loss = loss_fn(model_outputs, mb)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
            flight.loss = loss
            result.losses.append(loss)
            result.outputs.append(pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, model_outputs))
        return flight

    def _backward(self, mb: Microbatch, flight: _InFlight, scale: float, recv_critical: bool, send_critical: bool) -> None:
        if self.is_last:
            torch.autograd.backward(flight.loss * scale)
        else:
            names = self.send_boundary.grad_names
            grads = self._recv_gradients([flight.sent[n] for n in names], mb.index, recv_critical)
            pairs = [(flight.sent[n], g) for n, g in zip(names, grads) if flight.sent[n].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.recv_boundary is not None:
            grads = []
            for name in self.recv_boundary.grad_names:
                leaf = flight.leaves[name]
                grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            self._send_gradients(grads, mb.index, send_critical)

    # -- lowering ---------------------------------------------------------------------

    def _compiled_stage(self, inputs: list[torch.Tensor]) -> Callable:
        key = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in inputs)
        compiled = self._compiled.get(key)
        if compiled is None:
            scheduler, timeline = self.scheduler, self.timeline

            def forward(gm: fx.GraphModule):
                return lambda *a: GraphExecutor(gm, scheduler, timeline=timeline).run(*a)

            def backward(gm: fx.GraphModule):
                return lambda *a: GraphExecutor(gm, scheduler, timeline=timeline, phase="backward").run(*a)

            # The stage's gradients are reduced after the schedule, not inside its graphs: no hooks.
            compiled = self._compiled[key] = self._compile_training(
                self.module, inputs, forward=forward, backward=backward, compute=self.plan.compute, hooks=lambda gm, phase: (set(), set()),
                activation_memory_budget=self.plan.activation_memory_budget,
            )
        return compiled

    # -- boundary traffic ---------------------------------------------------------------

    def _peer(self, offset: int) -> int:
        return self.stage_index + offset  # index in this rank's pp group (ordered by stage)

    def _send(self, tensors, peer: int, kind: str, lane: str, tag: str) -> None:
        for i, t in enumerate(tensors):
            pending = self.scheduler.start_send(t.detach(), PP, peer, kind=kind, priority=PP, lane=lane, tag=f"{tag} {i}")
            if pending is not None:
                self._pending_sends.append(pending)

    def _recv(self, shapes_dtypes, peer: int, kind: str, lane: str, tag: str) -> list[torch.Tensor]:
        out, pendings = [], []
        for i, (shape, dtype) in enumerate(shapes_dtypes):
            buffer = torch.empty(shape, dtype=dtype)
            pendings.append(self.scheduler.start_recv(buffer, PP, peer, kind=kind, priority=PP, lane=lane, tag=f"{tag} {i}"))
            out.append(buffer)
        for pending in pendings:
            self.scheduler.wait(pending)
        return out

    def _send_activations(self, signature: tuple, tensors: list[torch.Tensor], index: int) -> None:
        peer = self._peer(+1)
        if (signature, "send") not in self._shapes:  # the receiver meets this signature now too
            self._shapes[(signature, "send")] = [t.shape for t in tensors]
            header = torch.tensor([d for t in tensors for d in t.shape], dtype=torch.int64)
            self._send([header], peer, "pp_shapes", "forward send", "shapes")
        self._send(tensors, peer, "pp_forward", "forward send", f"activations mb {index}")

    def _recv_activations(self, signature: tuple, index: int) -> list[torch.Tensor]:
        peer, specs = self._peer(-1), self.recv_boundary.tensors
        shapes = self._shapes.get((signature, "recv"))
        if shapes is None:
            (header,) = self._recv([((sum(t.ndim for t in specs),), torch.int64)], peer, "pp_shapes", "forward recv", "shapes")
            dims, shapes = header.tolist(), []
            for spec in specs:
                shapes.append(torch.Size(dims[: spec.ndim]))
                dims = dims[spec.ndim :]
            self._shapes[(signature, "recv")] = shapes
        return self._recv([(s, t.dtype) for s, t in zip(shapes, specs)], peer, "pp_forward", "forward recv", f"activations mb {index}")

    def _send_gradients(self, grads: list[torch.Tensor], index: int, critical: bool) -> None:
        codec = self.recv_boundary.codec
        if codec is not None:
            state = self.codec_state.setdefault(self.recv_boundary.index, {})
            grads = codec.encode(grads, state, critical)
        self._send(grads, self._peer(-1), "pp_backward", "backward send", f"gradients mb {index}")

    def _recv_gradients(self, sent: list[torch.Tensor], index: int, critical: bool) -> list[torch.Tensor]:
        specs = [(t.shape, t.dtype) for t in sent]
        codec = self.send_boundary.codec
        payload_specs = codec.payload_specs(specs, critical) if codec is not None else specs
        payload = self._recv(payload_specs, self._peer(+1), "pp_backward", "backward recv", f"gradients mb {index}")
        return codec.decode(payload, specs, critical) if codec is not None else payload

    # -- gradients across replicas and stages ---------------------------------------------

    def _gradient_syncs(self) -> tuple[GradientSync, GradientSync | None]:
        shards = self.program.runtime.shards
        shared = self.pipeline.shared
        for name, stages in shared.items():
            if sorted(stages) != [0, self.num_stages - 1]:
                raise ValueError(
                    f"parameter {name} is used by stages {stages}; only a weight shared by the first and last stage "
                    "(a tied embedding) is supported"
                )
        fused = self.pipeline.fuse_shared_sync

        def group(name: str) -> str:
            if name in shards:
                return shards[name]["replicated_over"]
            return "pp_ends_dp" if name in shared and fused else "dp"

        params = list(self.module.named_parameters())
        codec = self.stage.dp_codec
        self.dp_compressed = [
            (name, p) for name, p in params
            if codec is not None and p.requires_grad and group(name) == "dp" and codec.compresses(p.shape, p.dtype)
        ]
        compressed = {name for name, _ in self.dp_compressed}
        # group None: GradientSync passes these through; the codec reduces them (_reduce_gradients)
        slots = [Slot(name, p, None if name in compressed else group(name)) for name, p in params]
        scales = {slot.group: self.plan.grad_scale_for(slot.group) for slot in slots}  # expert gradients: 1/(dp x tp)
        sharded = self.program.runtime.shard_states  # ZeRO 1/2: this stage's state sharded over its dp group
        bucket_bytes = (sharded.get("bucket_bytes") if sharded else 0) or self.plan.grad_bucket_bytes
        options = dict(scale=self.plan.grad_scale, scales=scales, bucket_bytes=bucket_bytes)
        sync = ShardedGradSync(slots, self.scheduler, stage=sharded["stage"], **options) if sharded else GradientSync(slots, self.scheduler, **options)
        shared_slots = [Slot(name, p, "pp_ends") for name, p in params if name in shared and not fused]
        return sync, (GradientSync(shared_slots, self.scheduler, scale=1.0) if shared_slots else None)

    def _reduce_gradients(self) -> None:
        for sync in (self.grad_sync, self.shared_sync):
            if sync is None:
                continue
            for slot, s in enumerate(sync.slots):
                sync.ready(slot, s.param.grad)
            for slot, reduced in sync.finish().items():  # None under shard_states:stage=2: the bucket's shard holds it
                sync.slots[slot].param.grad = None if reduced is None else reduced.clone()
        if self.dp_compressed:
            grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.dp_compressed}
            reduce = lambda t: self.scheduler.all_reduce(t, "dp", kind="grad_powersgd", priority="grad")  # noqa: E731
            group_size = self.scheduler.group("dp", "grad").size
            reduced = self.stage.dp_codec.reduce(grads, self.dp_codec_state, reduce, group_size, self.plan.grad_scale_for("dp"))
            for name, p in self.dp_compressed:
                p.grad = reduced[name]

    def synchronize(self) -> None:
        """Under shard_states:stage=3, all-gather this stage's parameters, whole until the
        optimizer step frees them (once per step, not per micro-batch: torchtitan runs FSDP
        under pipelining the same way, reshard_after_forward=False); a no-op otherwise."""
        gather = getattr(self.grad_sync, "params", None)
        if gather is not None:
            gather.gather_all()

    # -- state ----------------------------------------------------------------------------

    @property
    def comm_stats(self):
        return self.scheduler.stats

    def get_extra_state(self) -> dict:
        return {
            "placement": self.placement,
            "stage": self.stage_index,
            "codec_state": {k: {n: t.clone() for n, t in v.items()} for k, v in self.codec_state.items()},
            "dp_codec_state": {n: t.clone() for n, t in self.dp_codec_state.items()},
        }

    def set_extra_state(self, state: dict) -> None:
        if state.get("stage") != self.stage_index or state.get("placement") != self.placement:
            raise ValueError(
                f"this checkpoint belongs to pipeline stage {state.get('stage')} with placement {state.get('placement')}, "
                f"not stage {self.stage_index} with {self.placement}; load it on the rank that saved it"
            )
        self.codec_state = {int(k): {n: t.clone() for n, t in v.items()} for k, v in state.get("codec_state", {}).items()}
        self.dp_codec_state = {n: t.clone() for n, t in state.get("dp_codec_state", {}).items()}
