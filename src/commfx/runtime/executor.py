"""The graph executor: runs a rewritten graph on this rank, torch.fx Interpreter style.

Subclasses override a short, documented set of methods:
- `run_node(node)`: every node (timing and tracing hooks go here);
- `call_collective(node, args, kwargs)`: nodes that communicate (commfx comm ops);
- `on_value(node, value)`: a node's value is ready (BackwardExecutor hands gradients to
  the gradient sync here, so their all-reduce starts while backward goes on).
A graph whose compute was compiled (compiler/compile_regions.py) holds each region as a
submodule called by one `call_module` node whose outputs are read by `getitem` nodes: the
executor runs it like any node, and the hooks above see each output as its own value.
ForwardExecutor settles a parameter whose update was deferred (defer_grad_sync) just before
the first node that uses it; under shard_states stage 3 (`params`) every executor gathers a
parameter bucket before its first reader and frees it after its last.
The comm scheduler is active for the whole run, so comm ops find it. A run with no per-node
work (no trace, no straggler, no parameter to settle or gather, no gradient bucket that
communicates) runs the graph's generated code instead (`needs_nodes`), which costs about a
microsecond a node instead of tens.
"""

from __future__ import annotations

import operator
import time

import torch.fx as fx

from .comm import CommScheduler, active
from .grad_sync import GradientSync
from .trace import Timeline

# The one registry of commfx ops that communicate (a collective inside, or a wait on one):
# the executor issues them as collectives and compiled regions end at them. An op that
# exchanges data inside (the embedding exchanges, the vocabulary-parallel loss) is one too.
COMM_OPS = frozenset({
    "all_to_all", "exchange_counts", "all_to_all_start", "wait_tensor", "all_reduce",
    "exchange_row_grads", "embedding_counts", "embedding_all_to_all",
    "vocab_parallel_loss", "vocab_parallel_loss_backward",
    "row_embedding", "row_sharded_embedding", "post_row_grads",  # schedule=2d: the runtime settles and posts rows there
})
_UNTIMED = {"placeholder", "output", "get_attr"}
REGION_REPORT = "commfx_regions"  # gm.meta: what compiling the graph's regions did (compiler.compile_regions)


def communicates(target) -> bool:
    """Whether calling `target` (an fx node's target) communicates: a commfx op in COMM_OPS."""
    return getattr(target, "namespace", None) == "commfx" and target._opname in COMM_OPS


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and communicates(node.target)


class GraphExecutor(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, scheduler: CommScheduler, *, timeline: Timeline | None = None, phase: str = "forward", params=None):
        super().__init__(gm, garbage_collect_values=True)
        self.scheduler = scheduler
        self.timeline = timeline
        self.phase = phase
        self.params = params  # shard_states stage 3: a param_gather.GraphGathers, which gathers and frees parameters around their uses

    def run(self, *args):
        with active(self.scheduler):
            if self.params is None and not self.needs_nodes():
                out = self.module(*args)  # the graph's own generated code: no per-node work to do
                self.after_direct_run(out)
            elif self.params is None:
                out = super().run(*args)
            else:
                self.params.begin(args)
                try:
                    out = super().run(*args)
                finally:
                    self.params.end()
        if self.scheduler.slow_debt_s > 0:
            pay_delay(self.scheduler)  # a straggler's graph ends no sooner than its stretched work
        return out

    def run_node(self, node: fx.Node):
        if self.params is not None:
            self.params.before(node, self.env)
        collective = is_collective(node)
        if collective and self.scheduler.slow_debt_s > 0:
            pay_delay(self.scheduler)  # an emulated straggler reaches each collective late
        start = time.perf_counter()
        if collective:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            value = self.call_collective(node, args, kwargs)
        else:
            blocked = self.scheduler.blocked_s
            value = super().run_node(node)
            if self.scheduler.slowdown > 1.0 and node.op not in _UNTIMED:
                stretch(self.scheduler, time.perf_counter() - start - (self.scheduler.blocked_s - blocked))
        if self.timeline is not None and node.op not in _UNTIMED and node.target is not operator.getitem:
            self.timeline.compute(node, self.phase, start, time.perf_counter(), blocked=collective)
        self.on_value(node, value)
        if self.params is not None:
            self.params.after(node)
        return value

    def needs_nodes(self) -> bool:
        """Whether this run needs the executor at each node (a trace, an emulated straggler,
        an override of the per-node methods); if not, the graph runs as its generated code."""
        cls = type(self)
        overridden = GraphExecutor.run_node is not _RUN_NODE or cls.call_collective is not GraphExecutor.call_collective
        return overridden or self.timeline is not None or self.scheduler.slowdown > 1.0 or self.scheduler.slow_debt_s > 0

    def after_direct_run(self, out) -> None:
        """Called with the outputs of a run that skipped the per-node methods."""

    def call_collective(self, node: fx.Node, args, kwargs):
        """Issue a communication node (override to time, trace or reorder it)."""
        return node.target(*args, **kwargs)

    def on_value(self, node: fx.Node, value) -> None:
        """Called with every node's value as soon as it exists."""


_RUN_NODE = GraphExecutor.run_node
SLEEP_SLICE_S = 1e-3  # a sleep costs tens of microseconds: owe small delays, pay them in slices


def stretch(scheduler: CommScheduler, compute_s: float) -> None:
    """An emulated straggler: a node that computed for `compute_s` takes `slowdown` times as
    long (the delay shrinks with the work, so a resized linear waits less). The delay is owed
    and paid once a slice has built up, before the next collective, or when the graph ends."""
    scheduler.slow_debt_s += (scheduler.slowdown - 1.0) * compute_s
    if scheduler.slow_debt_s >= SLEEP_SLICE_S:
        pay_delay(scheduler)


def pay_delay(scheduler: CommScheduler) -> None:
    """Sleep off the owed delay. Oversleeping is carried as credit (up to a slice), so the
    total stays calibrated; a longer overshoot is the machine's, not owed work."""
    if scheduler.slow_debt_s <= 0:
        return
    start = time.perf_counter()
    time.sleep(scheduler.slow_debt_s)
    scheduler.slow_debt_s = max(-SLEEP_SLICE_S, scheduler.slow_debt_s - (time.perf_counter() - start))


class ForwardExecutor(GraphExecutor):
    """Runs a forward graph whose first inputs are the parameters (aot_autograd's order, the
    gradient sync's slots). Before a node that is the first to use a parameter whose
    gradient is still on the wire, the parameter is settled (reduced, then stepped)."""

    def __init__(self, gm: fx.GraphModule, scheduler: CommScheduler, deferred, **kwargs):
        super().__init__(gm, scheduler, **kwargs)
        self.deferred = deferred  # DeferredStep
        self._first_use = first_uses(gm, deferred.sync.num_slots)
        if not deferred.ordered:  # the first forward: urgent buckets from where their parameters are first used
            nodes = {n: i for i, n in enumerate(gm.graph.nodes)}
            deferred.order({slot: nodes[n] / len(nodes) for n, slots in self._first_use.items() for slot in slots})

    def needs_nodes(self) -> bool:
        return self.deferred.pending or super().needs_nodes()

    def run_node(self, node: fx.Node):
        slots = self._first_use.get(node)
        if slots and self.deferred.pending:
            self.deferred.settle(slots)
        return super().run_node(node)


def first_uses(gm: fx.GraphModule, num_params: int) -> dict[fx.Node, list[int]]:
    """node -> the parameters (input indices < num_params) it is the first to use. Cached on the graph."""
    cached = gm.meta.get("commfx_first_uses")
    if cached is None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:num_params]
        slot_of, cached = {p: i for i, p in enumerate(placeholders)}, {}
        for node in gm.graph.nodes:
            for source in node.all_input_nodes:
                slot = slot_of.pop(source, None)
                if slot is not None:
                    cached.setdefault(node, []).append(slot)
        gm.meta["commfx_first_uses"] = cached
    return cached


class BackwardExecutor(GraphExecutor):
    """Runs a backward graph whose first outputs are parameter gradients (aot_autograd's
    order) and reduces them with `grad_sync` as they appear; returns the reduced ones."""

    def __init__(self, gm: fx.GraphModule, scheduler: CommScheduler, grad_sync: GradientSync, **kwargs):
        super().__init__(gm, scheduler, phase="backward", **kwargs)
        self.grad_sync = grad_sync
        self._communicates = bool(grad_sync.communicating_buckets)
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        self._slots: dict[fx.Node, list[int]] = {}
        for slot, value in enumerate(outputs[: grad_sync.num_slots]):
            if isinstance(value, fx.Node):
                self._slots.setdefault(value, []).append(slot)

    def on_value(self, node: fx.Node, value) -> None:
        for slot in self._slots.get(node, ()):
            self.grad_sync.ready(slot, value)

    def needs_nodes(self) -> bool:
        """A bucket whose all-reduce communicates starts during backward, at its last gradient."""
        return self._communicates or super().needs_nodes()

    def after_direct_run(self, out) -> None:
        for slot, value in enumerate(out[: self.grad_sync.num_slots]):
            self.grad_sync.ready(slot, value)

    def run(self, *args):
        outputs = list(super().run(*args))
        for slot, reduced in self.grad_sync.finish().items():  # None: deferred (defer_grad_sync)
            outputs[slot] = reduced
        return outputs


__all__ = ["COMM_OPS", "REGION_REPORT", "BackwardExecutor", "ForwardExecutor", "GraphExecutor", "communicates", "first_uses", "is_collective"]
