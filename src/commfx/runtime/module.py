"""The per-rank module `commfx.distribute` returns.

It owns the rewritten graph with only this rank's expert shards (memory is really
sharded). The runtime never compiles: on the first call for an input shape it hands the
graph to the compile function it was given (the compiler wing's `compile_training`:
aot_autograd forward and backward, scheduled) and from then on runs both graphs through
the graph executor; gradients are reduced by `GradientSync` as the backward graph produces
them. Its state_dict holds the local parameters under the original names (prefixed
`module.`, as with DDP) plus the expert sharding, which loading checks, and the packed
layers' expert placement and routing statistics (`expert_placement.py`), which loading
restores.

Called with another set of tensor inputs than it was captured with (eval without `labels`,
then training with them), it re-captures the model for that set through the `recapture`
callable the Python API hands it (the runtime never compiles) and keeps one program per
set, each with its own lowerings and gradient sync over the very same Parameter objects.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..plan import Plan
from .comm import CommScheduler, install_default
from .expert_placement import Decision, placements_of, replace_experts
from .deferred_step import DeferredStep, catching_up
from .executor import REGION_REPORT, BackwardExecutor, ForwardExecutor, GraphExecutor
from .grad_sync import GradientSync, Slot
from .backward_order import communicating_first
from .row_schedule import ROW_OPS, ROW_SCHEDULE, RowSchedule, hoist_row_posts
from .semi import make_controller
from .state_shards import ShardedGradSync
from .trace import Timeline


class CompiledModel(Protocol):
    """What the runtime needs of a rewritten model (the compiler's `Program` is one)."""

    gm: fx.GraphModule
    out_spec: pytree.TreeSpec  # rebuilds the model's output from the graph's flat outputs
    runtime: Any  # what the passes ask of the runtime (compiler.program.RuntimeNeeds): shards, comm schedule, ...
    input_names: list[str]  # the forward's parameter name of each graph input, in order
    signature: inspect.Signature | None  # the model's forward signature, to bind calls by name


# (graph module, example inputs, forward=runner, backward=runner) -> differentiable callable;
# a runner takes a lowered graph and returns what runs it.
CompileTraining = Callable[..., Callable]

# (args, kwargs) of a call with new tensor inputs -> the model captured and rewritten for them,
# its graph module holding the first program's Parameter objects (a collective: every rank).
Recapture = Callable[[tuple, dict], CompiledModel]

# Runtime state a second program would not share: the field of `program.runtime` that holds
# it -> the pass that made it, and why.
BACKWARD_SCHEDULED = "commfx_backward_scheduled"  # gm.meta: row posts hoisted, backward_order applied

_STATE_OF_ONE_PROGRAM = {
    "expert_placement": ("pack_experts", "its expert placement and routing statistics are runtime state keyed by the first graph's op ids"),
    "tp_resize": ("resize_tp", "its shard widths are runtime state keyed by the first graph's op ids"),
    "shard_states": ("shard_states", "its optimizer's shards are cut from the first graph's gradient buckets"),
}


@dataclass
class Captured:
    """One captured program (per set of tensor input names): its graph module, the gradient
    sync over that module's parameters (in aot_autograd's order) and its lowerings by shape."""

    program: CompiledModel
    gm: fx.GraphModule
    grad_sync: GradientSync
    compiled: dict[tuple, object] = field(default_factory=dict)


class DistributedModule(torch.nn.Module):
    def __init__(
        self,
        program: CompiledModel,
        plan: Plan,
        scheduler: CommScheduler,
        placement: dict[str, list[int]],
        compile_training: CompileTraining,
        recapture: Recapture | None = None,
    ):
        super().__init__()
        self._compile_training = compile_training
        self.module = program.gm
        self.program = program
        self.plan = plan
        self.scheduler = scheduler
        self.placement = placement  # sharded parameter -> [start, stop) of the full dim 0 held here
        install_default(scheduler)
        self.grad_sync = configure_comm(program, plan, scheduler, self.module.named_parameters(remove_duplicate=False))
        # defer_grad_sync: the all-reduce runs on into the next forward once an optimizer is attached
        self.deferred = DeferredStep(self.grad_sync) if program.runtime.grad_sync == "next_forward" else None
        # split_embedding_comm:schedule=2d: embedding row gradients exchanged into the next forward
        self.rows = scheduler.op_state[ROW_SCHEDULE] = RowSchedule(scheduler, dict(self.module.named_parameters()), self.module)
        if getattr(self.grad_sync, "params", None) is not None:  # shard_states stage 3: load into whole parameters, then cut shards
            self.register_load_state_dict_pre_hook(lambda *_: self.synchronize())
            self.register_load_state_dict_post_hook(lambda *_: self.grad_sync.params.refresh_shards())
        self.timeline: Timeline | None = None  # set to record a trace (commfx run --trace)
        # resize_tp: shard widths as runtime state, set each window by the SEMI controller
        resize = program.runtime.tp_resize
        self.straggler = make_controller(self.module, resize, scheduler, plan.topology, plan.topology.tp_index(scheduler.rank)) if resize else None
        if self.straggler is not None:  # the units this rank computes for another (resize_tp unit migration): parameters too
            self.tp_slots = self.straggler.resizer.slots
        # One lowering per input signature. The captured graph is symbolic in batch and (where
        # the model allows) sequence length and the same on every rank, so a rank lowers a new
        # shape on its own: its collectives are the graph's, in the graph's order, whatever
        # the shape. The bound keeps a stream of new lengths from lowering without end.
        self._compiled: dict[tuple, object] = {}
        self.max_signatures = 16
        # One program per set of tensor inputs (see `_captured_for`), the first one this.
        self._recapture = recapture
        self._captures = {frozenset(program.input_names): Captured(program, self.module, self.grad_sync, self._compiled)}
        self.max_captures = 4
        # Packed layers (pack_experts): their placement and routing statistics, by op id.
        self.packing = program.runtime.expert_placement
        self.placements = placements_of(scheduler)
        for op_id, spec in self.packing.items():
            layer = self.placements.get(op_id, spec["num_experts"], spec["ranks"])
            layer.weights, layer.payback, layer.row_bytes = list(spec["weights"]), spec.get("payback", math.inf), spec.get("row_bytes", 0)
        self.optimizer_steps = 0
        self.placement_log: list[list[Decision]] = []
        # (phase, the compiler's region report or None) per graph lowered so far (Plan.compute)
        self.region_reports: list[tuple[str, Any]] = []

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        """Run the rewritten model on this rank's batch.

        A call with another set of tensor inputs than any before (`labels=` added or left
        out) re-captures the model for it once (rank 0 says so on stderr) and runs that
        program from then on; both programs train the same parameters. Like any collective,
        every rank must make the same call: the same input names, in the same step."""
        if self.rows.pending and not (torch.is_grad_enabled() and self.training):
            self.rows.settle()  # an eval call: schedule=2d tables whole, not just the rows it reads
        captured, inputs = self._captured_for(args, kwargs)
        if inputs and all(t.dim() and t.shape[0] == 0 for t in inputs):
            return self._forward_without_rows(inputs, captured)
        return self._run(inputs, captured)

    def _captured_for(self, args: tuple, kwargs: dict) -> tuple[Captured, tuple[torch.Tensor, ...]]:
        """The program for this call's set of tensor inputs, captured now if it is new, and
        the call's tensors in that program's input order.

        Re-capture traces a skeleton of the model (see `commfx.api`) whose parameters are this
        module's own, so the new graph module holds the same Parameter objects (expert shards
        included): one optimizer over `parameters()` trains every program, and each program's
        gradient sync reduces those parameters. The new program's graph must be the same on
        every rank (checked, as `distribute` does)."""
        if not self.program.input_names:  # a graph without named inputs: taken as given
            return self._captures[frozenset()], tuple(args)
        bound = bind_call(self.program, args, kwargs)
        names = frozenset(n for n, v in bound.items() if isinstance(v, torch.Tensor))
        captured = self._captures.get(names)
        if captured is None:
            captured = self._capture_new(names, args, kwargs)
        return captured, tuple(bound[n] for n in captured.program.input_names)

    def _capture_new(self, names: frozenset, args: tuple, kwargs: dict) -> Captured:
        refused = self._recapture_refused_by()
        if self._recapture is None or refused is not None:
            why = (
                f"Re-capture for new inputs is not supported with {refused[0]} yet ({refused[1]})"
                if refused else "This module cannot re-capture for new inputs (it was not made by commfx.distribute)"
            )
            graph_inputs(self.program, args, kwargs, why)  # raises the mismatch, with `why`
        if len(self._captures) >= self.max_captures:
            known = "; ".join("(" + ", ".join(c.program.input_names) + ")" for c in self._captures.values())
            raise RuntimeError(
                f"this module was captured for {len(self._captures)} sets of inputs already (the limit, max_captures): "
                f"{known}; the call's ({', '.join(sorted(names))}) would capture again. Call it with one of those "
                "sets, or raise DistributedModule.max_captures."
            )
        if self.scheduler.rank == 0:
            first = ", ".join(self.program.input_names)
            print(
                f"commfx: the module was captured with inputs ({first}) and is now called with ({', '.join(sorted(names))}); "
                f"re-capturing the model for these inputs on every rank ({len(self._captures) + 1} of at most "
                f"{self.max_captures} input sets; each is kept)",
                file=sys.stderr,
                flush=True,
            )
        calls = self.scheduler.all_gather_object(sorted(names))  # before any rank captures: all or none
        if any(c != calls[0] for c in calls):
            other = next(i for i, c in enumerate(calls) if c != calls[0])
            raise TypeError(
                f"rank 0 called the module with inputs ({', '.join(calls[0])}) and rank {other} with "
                f"({', '.join(calls[other])}): every rank must make the same call in the same step (SPMD)"
            )
        program = self._recapture(args, kwargs)
        if frozenset(program.input_names) != names:
            raise RuntimeError(f"internal: re-capture for inputs ({', '.join(sorted(names))}) named them ({', '.join(program.input_names)})")
        own = {id(p) for p in self.module.parameters()}
        foreign = [n for n, p in program.gm.named_parameters(remove_duplicate=False) if id(p) not in own]
        if foreign:
            raise RuntimeError(f"internal: the re-captured graph holds parameters of its own ({', '.join(foreign[:4])}), not this module's")
        grad_sync = configure_comm(program, self.plan, self.scheduler, program.gm.named_parameters(remove_duplicate=False))
        captured = self._captures[names] = Captured(program, program.gm, grad_sync)
        return captured

    def _recapture_refused_by(self) -> tuple[str, str] | None:
        """(pass, why) when a pass's runtime state could not be shared by a second program."""
        if self.deferred is not None:
            return "defer_grad_sync", "the gradients it leaves on the wire and the steps they owe belong to the first graph's gradient sync"
        return next((refusal for key, refusal in _STATE_OF_ONE_PROGRAM.items() if getattr(self.program.runtime, key)), None)

    def _forward_without_rows(self, inputs: tuple[torch.Tensor, ...], captured: Captured | None = None) -> Any:
        """This rank has no rows this step (a global batch smaller than the world). It still
        takes part in every collective: it runs the graph on one row of zeros and returns
        empty outputs; a scalar output (a loss) is returned times zero. Either way its
        gradients are zero, as a rank with no data contributes nothing to the sum."""
        stand_in = tuple(t.new_zeros((1, *t.shape[1:])) for t in inputs)
        out = self._run(stand_in, captured)

        def empty(value):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 1:
                return value[:0]
            return value * 0 if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        return pytree.tree_map(empty, out)

    def _run(self, inputs: tuple[torch.Tensor, ...], captured: Captured | None = None) -> Any:
        captured = captured or self._captures[frozenset(self.program.input_names)]
        if self.straggler is not None and torch.is_grad_enabled():
            self.straggler.begin_step()
        signature = tuple((tuple(t.shape), t.dtype) for t in inputs)
        lowered = captured.compiled
        compiled = lowered.get(signature)
        if compiled is None:
            if len(lowered) >= self.max_signatures:
                raise RuntimeError(
                    f"{len(lowered)} input shapes were lowered already (the limit, max_signatures); "
                    f"another, {[s for s, _ in signature]}, would lower again. Pad inputs to a few lengths "
                    "(buckets), or raise DistributedModule.max_signatures."
                )
            if lowered:
                print(
                    f"commfx: rank {self.scheduler.rank} lowers the graph for new input shapes "
                    f"{[list(s) for s, _ in signature]} ({len(lowered) + 1} of at most {self.max_signatures})",
                    file=sys.stderr,
                    flush=True,
                )
            compiled = lowered[signature] = self._compile(inputs, captured)
        flat = compiled(*inputs)
        return pytree.tree_unflatten(list(flat), captured.program.out_spec)

    def _compile(self, inputs, captured: Captured):
        gather = getattr(captured.grad_sync, "params", None)  # shard_states stage 3: parameters gathered around each use
        params = gather.run if gather is not None else (lambda gm, keep_last=False: None)

        def forward(gm):
            self.region_reports.append(("forward", gm.meta.get(REGION_REPORT)))
            if self.deferred is not None:
                return lambda *args: ForwardExecutor(gm, self.scheduler, self.deferred, timeline=self.timeline).run(*args)
            return lambda *args: GraphExecutor(gm, self.scheduler, timeline=self.timeline, params=params(gm, keep_last=True)).run(*args)

        def schedule_backward(gm):  # once: before the regions are cut under Inductor, else for the interpreter
            if gm.meta.get(BACKWARD_SCHEDULED):
                return
            gm.meta[BACKWARD_SCHEDULED] = True
            hoist_row_posts(gm)
            if captured.program.runtime.backward_order == "communicating_first":
                communicating_first(gm, communicating_gradients(gm, captured.grad_sync))

        def backward(gm):
            self.region_reports.append(("backward", gm.meta.get(REGION_REPORT)))
            schedule_backward(gm)

            def run(*args):
                if self.deferred is not None:
                    self.synchronize()  # what the forward did not use is settled before new gradients come
                grads = BackwardExecutor(gm, self.scheduler, captured.grad_sync, timeline=self.timeline, params=params(gm)).run(*args)
                if self.straggler is not None:
                    self.straggler.end_step()  # the step is over on this rank: time it, maybe resize
                return grads

            return run

        def hooks(gm, phase):
            if phase == "backward":
                schedule_backward(gm)  # so a region ends where rows are posted
            return region_hooks(gm, phase, captured.grad_sync, deferred=self.deferred is not None, gathered=gather is not None)

        compile_args = {"forward": forward, "backward": backward, "compute": self.plan.compute, "hooks": hooks,
                        "activation_memory_budget": self.plan.activation_memory_budget}
        if gather is None:
            return self._compile_training(captured.gm, inputs, **compile_args)
        with gather.materialized():  # tracing reads shapes only: no gather, so a rank may lower a new shape alone
            return self._compile_training(captured.gm, inputs, **compile_args)

    @property
    def comm_stats(self):
        return self.scheduler.stats

    def compile_note(self) -> str | None:
        """One line on the compiled regions of the graphs lowered so far (None: interpreted)."""
        return regions_note(self.region_reports)

    def synchronize(self) -> None:
        """Apply every gradient still on the wire and the optimizer step it missed
        (defer_grad_sync; a no-op otherwise). state_dict() and re-placement call it; call it
        before reading parameters or gradients outside forward and backward. Under
        shard_states:stage=3 it all-gathers every parameter, whole until the next step."""
        self.settle()
        self._gather_whole()

    def settle(self) -> None:
        """Apply every gradient still on the wire and the optimizer step it missed
        (defer_grad_sync), and every embedding row still posted; unlike `synchronize`, leave
        stage 3's parameters sharded: what a training loop's step boundary needs, since the
        next forward gathers each bucket where it is read."""
        if self.deferred is not None:
            self.deferred.settle()
        self.rows.settle()

    def _gather_whole(self) -> None:
        """Under shard_states stage 3, all-gather every parameter (whole until the next step)."""
        gather = getattr(self.grad_sync, "params", None)
        if gather is not None:
            gather.gather_all()

    def next_batch(self, *args: torch.Tensor, **kwargs: Any) -> None:
        """The next call's inputs, a batch ahead (call it before this step's backward, on every
        rank): under split_embedding_comm:schedule=2d the embedding rows that batch reads are
        exchanged first and each rank's next lookup waits only behind them. Without it every
        row is exchanged as urgent; it changes no value either way."""
        bound = bind_call(self.program, args, kwargs) if self.program.input_names else dict(enumerate(args))
        names = self.program.input_names or list(bound)
        self.rows.set_next_batch(tuple(bound[n] for n in names))

    # -- expert placement (pack_experts) -------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-place packed experts every `pack_experts:replace_every` steps of `optimizer`
        (after its step, on every rank alike), moving its state with the weights; under
        defer_grad_sync, let `optimizer` step parameters whose gradients arrive late."""
        if isinstance(self.grad_sync, ShardedGradSync) and getattr(optimizer, "sync", None) is not self.grad_sync:
            raise TypeError(
                "this module's plan has shard_states, whose optimizer steps only this rank's shard; make it with "
                "commfx.shard_optimizer(dm, torch.optim.AdamW, lr=...) instead of over dm.parameters()"
            )
        if self.deferred is not None:
            self.deferred.attach(optimizer)
        if self._has_row_ops():
            self.rows.attach(optimizer)  # schedule=2d tables: stepped when their rows are in
        if self.straggler is not None:  # resize_tp: migrated units move their optimizer state with them
            self.straggler.attach_optimizer(optimizer)
        every = max((spec["replace_every"] for spec in self.packing.values()), default=0)
        if not every:
            return

        def after_step(opt, args, kwargs):
            if catching_up(opt):
                return  # a deferred parameter's or table's catch-up, not a training step
            if self.scheduler.local_only:
                return  # commfx bench's compute-only replay: no real statistics, no real moves
            self.optimizer_steps += 1
            if self.optimizer_steps % every == 0:
                self.replace_experts(opt)

        optimizer.register_step_post_hook(after_step)

    def _settle_experts(self) -> None:
        """Settle what a re-placement reads and moves: the packed experts' weights, their
        deferred gradients applied (defer_grad_sync), whole under shard_states stage 3. Other
        deferred gradients stay on the wire into the next forward, as on any step."""
        if self.deferred is not None:
            moving = {id(self.module.get_parameter(t)) for layer in self.placements.layers.values() for t in layer.weights}
            self.deferred.settle([i for i, slot in enumerate(self.grad_sync.slots) if id(slot.param) in moving])
        self._gather_whole()

    def _has_row_ops(self) -> bool:
        return any(n.op == "call_function" and getattr(n.target, "namespace", None) == "commfx" and n.target._opname in ROW_OPS
                   for n in self.module.graph.nodes)

    def replace_experts(self, optimizer: torch.optim.Optimizer | None = None) -> list[Decision]:
        """Re-place every packed layer's experts now from the all-reduced routing statistics
        (collective: call on every rank at the same point, between steps)."""
        self._settle_experts()
        balance = min((spec["balance"] for spec in self.packing.values()), default=0.1)
        decisions = replace_experts(self.placements, self.scheduler, self.module, optimizer, balance, step=self.optimizer_steps)
        self.placement_log.append(decisions)
        return decisions

    def get_extra_state(self) -> dict:
        self.synchronize()  # runs before the parameters are saved (this module's own state comes first)
        state = {
            "placement": self.placement,
            "world_size": self.plan.topology.world_size,
            "expert_placement": self.placements.state(),
            "optimizer_steps": self.optimizer_steps,
        }
        if self.straggler is not None:
            state["resize_tp"] = self.straggler.state_dict()
        return state

    def set_extra_state(self, state: dict) -> None:
        if state.get("placement") != self.placement:
            raise ValueError(
                "this checkpoint holds a different expert placement "
                f"({state.get('placement')}) than this rank ({self.placement}); load it on the rank "
                "that saved it, with the same world size and ep"
            )
        # The saved expert shards are in the saved placement's slots: restore it with them.
        self.placements.load_state(state.get("expert_placement", {}))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        if self.straggler is not None and "resize_tp" in state:
            self.straggler.load_state_dict(state["resize_tp"])


def graph_inputs(program: CompiledModel, args: tuple, kwargs: dict, why: str = "") -> tuple[torch.Tensor, ...]:
    """The graph's inputs from a call, bound by name: the model may be called positionally
    or by keyword, whichever way it was captured (HF style: input_ids=, labels=). A call
    with other tensor inputs is an error; `why` says why it is not re-captured."""
    names = program.input_names
    if not names or (not kwargs and len(args) == len(names) and program.signature is None):
        return tuple(args)
    bound = bind_call(program, args, kwargs)
    missing = [n for n in names if not isinstance(bound.get(n), torch.Tensor)]
    extra = [n for n, v in bound.items() if isinstance(v, torch.Tensor) and n not in names]
    if missing or extra:
        raise TypeError(
            f"this module was captured with tensor inputs ({', '.join(names)}); the call "
            + (f"lacks {', '.join(missing)}" if missing else f"adds {', '.join(extra)}")
            + (f". {why}" if why else "")
            + ". Call it with the same inputs at every step (other shapes are fine), or distribute again."
        )
    return tuple(bound[n] for n in names)


def bind_call(program: CompiledModel, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by the forward's parameter names (positional ones without a
    signature as *0, *1, ...; HF's **kwargs opened up)."""
    names = program.input_names
    if not names or (not kwargs and len(args) == len(names) and program.signature is None):
        return dict(zip(names, args))
    if program.signature is not None:
        try:
            bound = program.signature.bind_partial(*args, **kwargs).arguments
        except TypeError as error:
            raise TypeError(f"{error}; the model was captured with inputs {', '.join(names)}") from None
    else:
        bound = {**{f"*{i}": a for i, a in enumerate(args)}, **kwargs}
    for name, value in list(bound.items()):  # HF forwards take most inputs through **kwargs
        if isinstance(value, dict) and program.signature is not None and name in program.signature.parameters:
            if program.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name))
    return bound


def regions_note(reports: list[tuple[str, Any]]) -> str | None:
    """'compiled regions: forward 5 (112 nodes), backward 20 (156 nodes), 3 left interpreted; Inductor 5.7 s'."""
    done = [(phase, r) for phase, r in reports if r is not None]
    if not done:
        return None
    parts = [f"{phase} {len(r.sizes)} ({sum(r.sizes)} nodes)" for phase, r in done]
    left = sum(r.interpreted for _, r in done)
    notes = [n for _, r in done for n in r.notes]
    line = f"compiled regions: {', '.join(parts)}, {left} left interpreted; Inductor {sum(r.seconds for _, r in done):.1f} s"
    return line + (f" ({notes[0]}{'; ...' if len(notes) > 1 else ''})" if notes else "")


def communicating_gradients(gm: fx.GraphModule, grad_sync: GradientSync) -> set[fx.Node]:
    """The backward graph's gradient outputs that a bucket over more than one rank carries."""
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    slots = [s for b in grad_sync.communicating_buckets for s in b.slots]
    return {outputs[s] for s in slots if s < len(outputs) and isinstance(outputs[s], fx.Node)}


def region_hooks(gm: fx.GraphModule, phase: str, grad_sync: GradientSync, *, deferred: bool, gathered: bool) -> tuple[set, set]:
    """Where this runtime acts in a lowered graph, as (nodes a compiled region must start at,
    nodes it must end after): in backward each communicating gradient bucket's last gradient
    (its all-reduce starts there); in forward the first use of a deferred bucket's parameters
    (defer_grad_sync settles it there) and, under shard_states stage 3, each bucket's first and
    last reader (gathered before, freed after). A bucket over a group of one rank needs none."""
    before: set[fx.Node] = set()
    after: set[fx.Node] = set()
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    buckets = grad_sync.communicating_buckets
    if phase == "backward":
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        for bucket in buckets:
            last = [outputs[s] for s in bucket.slots if s < len(outputs) and isinstance(outputs[s], fx.Node)]
            if last:
                after.add(max(last, key=position.__getitem__))
        return before, after
    params = [n for n in gm.graph.nodes if n.op == "placeholder"][: grad_sync.num_slots]
    for bucket in buckets:
        readers = sorted({u for s in bucket.slots if s < len(params) for u in params[s].users}, key=position.__getitem__)
        if readers and (deferred or gathered):
            before.add(readers[0])
        if readers and gathered:
            after.add(readers[-1])
    return before, after


def configure_comm(program: CompiledModel, plan: Plan, scheduler: CommScheduler, named_params, *, group_of=None) -> GradientSync:
    """Apply `program`'s comm schedule (set by partition_a2a) and all-to-all algorithms (set by
    hierarchical_a2a: one for every all-to-all, or one per MoE site) to `scheduler` (priority on or off) and return the gradient sync for
    `named_params` (in aot_autograd's order): plan's bucket size (shard_states may set its own), the
    schedule's chunk size; sharded buckets under shard_states."""
    needs = program.runtime
    shards, schedule = needs.shards, needs.comm_schedule
    reduced_in_graph = set(needs.reduced_in_graph)  # e.g. sparse embedding exchange
    scheduler.dispatcher.enforce_priority = schedule.priority
    scheduler.a2a_algorithm = needs.a2a_algorithm
    scheduler.a2a_sites = dict(needs.a2a_sites)
    slots = [
        Slot(name, param, None if name in reduced_in_graph else group_of(name) if group_of else (shards[name]["replicated_over"] if name in shards else "dp"))
        for name, param in named_params
    ]
    scales = {slot.group: plan.grad_scale_for(slot.group) for slot in slots}
    sharded = {"stage": needs.shard_states["stage"]} if needs.shard_states else {}
    bucket_bytes = (needs.shard_states.get("bucket_bytes") if needs.shard_states else 0) or plan.grad_bucket_bytes
    return (ShardedGradSync if sharded else GradientSync)(
        slots,
        scheduler,
        **sharded,
        scale=plan.grad_scale,
        scales=scales,
        bucket_bytes=bucket_bytes,
        chunk_bytes=schedule.grad_chunk_bytes,
        **({"reduce_dtype": plan.grad_reduce_dtype} if plan.grad_reduce_dtype != "fp32" else {}),
    )
