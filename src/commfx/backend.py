"""The torch.compile backend: `torch.compile(model, backend=commfx.backend(plan))`.

Dynamo hands us its graph; we bring it to commfx's convention (capture.to_fx_convention),
run the plan's passes, lower with aot_autograd into forward and backward graphs, and run
both through the runtime's graph executor. The user keeps owning full-size parameters
(torch.compile cannot change a module's parameters), so expert weights are sliced in the
graph at run time (`commfx.local_shard`) rather than re-allocated: for memory-sharded
experts use `commfx.distribute`. Gradients are synchronised during backward by the same
GradientSync as `distribute`: full-size expert weights get their rows only from the rank
that owns them, so they are summed over the whole world.

dynamo may hand several graphs (graph breaks in HF's mask and loss code, or the user's
own): each is lowered and run by the runtime (so its parameters' gradients are synchronised
too), and only graphs with an MoE block get the MoE passes. A graph takes its parameters
and buffers as inputs on every call: after a break inside a layer, dynamo calls the same
graph for every layer, each time with that layer's weights. Weights used outside every
graph get no gradient sync: a graph break inside a Python loop makes dynamo run that whole
frame eagerly (a model's embeddings and head, when its layer loop breaks). Given the model
(`commfx.backend(plan, model=model)`), the backend all-reduces those too
(runtime/eager_grads.py); without it, a world above 1 whose graphs broke gets a warning.

The name "commfx" is registered through the `torch_dynamo_backends` entry point; used by
name it reads the pass list from COMMFX_PASSES (default lift,expert_parallel) and the
world from the initialised process group.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import sys
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from .compiler.capture import to_fx_convention, tokens_of
from .compiler.lower import compile_training
from .compiler.program import Program
from .compiler.pass_manager import check_plan, run_passes
from .compiler.precision import apply_precision
from .plan import PassSpec, Plan, PlanError, said_once_per_node
from .runtime.comm import CommScheduler, build_groups, install_default, local_scheduler
from .runtime.devices import module_device_type, world_device_type
from .runtime.eager_grads import EagerGradientSync
from .runtime.executor import BackwardExecutor, GraphExecutor
from .runtime.grad_sync import GradientSync
from .runtime.module import configure_comm
from .runtime import rank_errors


class CommfxBackend:
    def __init__(self, plan: Plan, model: torch.nn.Module | None = None):
        self.plan = _shard_in_graph(plan)
        self.model = model
        if "defer_grad_sync" in plan.pass_names():
            raise PlanError(
                "defer_grad_sync needs commfx.distribute (whose module knows the optimizer and steps deferred parameters "
                "late); under torch.compile's commfx backend gradients are reduced in backward: drop it from the plan"
            )
        if "shard_states" in plan.pass_names():
            raise PlanError(
                "shard_states needs commfx.distribute and commfx.shard_optimizer (its optimizer steps this rank's shard); "
                "under torch.compile's commfx backend optimizer state stays replicated: drop it from the plan"
            )
        if plan.grad_reduce_dtype != "fp32":
            raise PlanError(
                f"--grad-reduce {plan.grad_reduce_dtype} needs commfx.distribute; under torch.compile's commfx backend "
                "gradients outside the compiled graphs are reduced eagerly in their own dtype: drop it (fp32)"
            )
        try:
            check_plan(self.plan)
        except PlanError as error:
            raise said_once_per_node(error) from None
        self.programs: list[Program] = []
        # Per compiled graph: {"forward": gm, "backward": gm}; backward appears at the first backward.
        self.graphs: list[dict[str, fx.GraphModule]] = []
        self._scheduler: CommScheduler | None = None
        self._agreed_tokens: int | None = None
        self._syncs: list[GradientSync] = []
        self.eager_sync: EagerGradientSync | None = None
        self._warned_breaks = False

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        scheduler = self._scheduler_for_world()
        if not _has_user_tensors(gm, example_inputs):
            # A piece dynamo cut off from the model's inputs (HF's mask code before the layers):
            # no tokens, so nothing to rewrite. It runs as dynamo traced it; gradients of weights
            # it reads are reduced by the eager sync (given the model), like code between graphs.
            return gm.forward
        program, positions, bound = _program_from_dynamo(gm, example_inputs)
        user_inputs = [example_inputs[i] for i in positions]
        if self._agreed_tokens is None:
            # The first graph is compiled by every rank together (SPMD); later ones (recompiles
            # for new shapes, maybe on one rank only) reuse its figure and run no collective.
            self._agreed_tokens = _world_max(scheduler, _size_hint(tokens_of(tuple(user_inputs))))
        program.tokens_per_rank = self._agreed_tokens
        apply_precision(program.gm, self.plan.precision)  # Plan.precision's casts, before any pass
        program = run_passes(program, self.plan, where_applicable=True)
        lowering, bound = _tensors_as_inputs(program.gm, bound)
        # The user's parameters are full-size (experts sliced in-graph), so every gradient,
        # expert rows included, is summed over the world.
        parameters = [(name, example_inputs[i]) for name, i in bound if isinstance(example_inputs[i], torch.nn.Parameter)]
        sync = configure_comm(program, self.plan, scheduler, parameters, group_of=lambda _: "world")
        self._syncs.append(sync)
        self._warn_if_weights_may_run_eagerly(scheduler)
        graphs: dict[str, fx.GraphModule] = {}

        def forward(graph_module: fx.GraphModule):
            graphs["forward"] = graph_module
            return lambda *args: GraphExecutor(graph_module, scheduler).run(*args)

        def backward(graph_module: fx.GraphModule):
            graphs["backward"] = graph_module
            return lambda *args: BackwardExecutor(graph_module, scheduler, sync).run(*args)

        sources = [i for _, i in bound] + positions
        with _dynamic_output_shapes(user_inputs):
            compiled = compile_training(lowering, [example_inputs[i] for i in sources], forward=forward, backward=backward, fake_inputs=True,
                                        compute=self.plan.compute, activation_memory_budget=self.plan.activation_memory_budget)
        self.programs.append(program)
        self.graphs.append(graphs)

        parameter_positions = [i for _, i in bound if isinstance(example_inputs[i], torch.nn.Parameter)]

        def run(*args):
            # dynamo passes every graph input each call, parameters too: a graph it reuses
            # (one layer's code called for every layer) gets each call's own weights.
            if self.eager_sync is not None:  # this graph's sync reduces these: the eager sync leaves them
                self.eager_sync.in_graphs.update(id(args[i]) for i in parameter_positions)
            return compiled(*[args[i] for i in sources])

        return run

    def _scheduler_for_world(self) -> CommScheduler:
        if self._scheduler is None:
            topology = self.plan.topology
            if dist.is_initialized():
                if dist.get_world_size() != topology.world_size:
                    raise PlanError(
                        f"the plan is for world size {topology.world_size} but the process group has "
                        f"{dist.get_world_size()} ranks; make them agree"
                    )
                rank = dist.get_rank()
                device_type = module_device_type(self.model) if self.model is not None else world_device_type()  # CUDA: NCCL lanes
                groups = build_groups(topology, rank, timeout_s=self.plan.collective_timeout_s, device_type=device_type)
                self._scheduler = CommScheduler(topology, rank, groups, timeout_s=self.plan.collective_timeout_s, device_type=device_type)
            elif topology.world_size == 1:
                self._scheduler = local_scheduler(topology)
            else:
                raise PlanError("the commfx backend needs torch.distributed initialised for a world size above 1")
            install_default(self._scheduler)
            if self.model is not None:
                self.eager_sync = EagerGradientSync(self._scheduler, self.plan.grad_scale_for("world"))
                self.eager_sync.watch(self.model)
        return self._scheduler

    def _warn_if_weights_may_run_eagerly(self, scheduler: CommScheduler) -> None:
        """Without the model the backend cannot see weights outside its graphs: say so once
        when dynamo broke the model into pieces on a world where that matters."""
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        if self.model is not None or self._warned_breaks or scheduler.group("world").size == 1 or not breaks:
            return
        self._warned_breaks = True
        message = (
            "commfx backend: dynamo broke the model into several graphs; weights used by code it runs outside every "
            "graph (a frame it runs eagerly) get no gradient sync from the backend. Pass the model, "
            "commfx.backend(plan, model=model), to synchronise them too, or remove the graph break"
        )
        warnings.warn(message, stacklevel=2)
        if scheduler.rank == 0:
            print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _dynamic_output_shapes(fake_inputs: list):
    """All-to-all outputs have data-dependent row counts. dynamo allows such ops only under
    fullgraph=True; the graphs it hands a backend are whole regions either way, so the
    lowering (which traces the all-to-alls) may always create their sizes."""
    fake_mode = torch._guards.detect_fake_mode(fake_inputs)
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None or shape_env.settings.allow_dynamic_output_shape_ops:
        yield
        return
    saved = shape_env.settings
    shape_env.settings = dataclasses.replace(saved, allow_dynamic_output_shape_ops=True)
    try:
        yield
    finally:
        shape_env.settings = saved


def _size_hint(n) -> int:
    """A concrete value for a possibly symbolic size (dynamo's example inputs)."""
    return n if isinstance(n, int) else int(n.node.hint)


def _world_max(scheduler: CommScheduler, value: int) -> int:
    """The largest `value` over the world: choices made from it agree on every rank."""
    return max(scheduler.all_gather_object(value)) if scheduler.group("world").size > 1 else value


def backend(plan: Plan, model: torch.nn.Module | None = None) -> CommfxBackend:
    """A torch.compile backend that runs `plan` (call once per model; it keeps state).
    `model`: the module being compiled, so gradients of weights that dynamo runs outside
    every graph (after a graph break) are synchronised too."""
    rank_errors.install()  # under torchrun, a commfx error every rank hits prints once
    return CommfxBackend(plan, model)


_BY_NAME: dict[tuple[str, int], CommfxBackend] = {}


def default_backend(gm: fx.GraphModule, example_inputs: list):
    """The backend registered as "commfx": plan from COMMFX_PASSES and the current world.

    One backend per (pass list, world), so every graph dynamo hands it shares one set of
    process groups and one comm scheduler, as with `commfx.backend(plan)`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    passes = os.environ.get("COMMFX_PASSES", "lift,expert_parallel")
    key = (passes, world)
    rank_errors.install()
    if key not in _BY_NAME:
        _BY_NAME[key] = CommfxBackend(Plan.from_cli(passes, world_size=world))
    return _BY_NAME[key](gm, example_inputs)


def _shard_in_graph(plan: Plan) -> Plan:
    passes = tuple(
        PassSpec(p.name, {**p.options, "shard_in_graph": True}) if p.name in ("expert_parallel", "split_embedding_comm") else p
        for p in plan.passes
    )
    return dataclasses.replace(plan, passes=passes)


def _is_weight(node: fx.Node, value) -> bool:
    """A graph input that is one of the model's parameters or buffers (dynamo passes both)."""
    return isinstance(value, torch.nn.Parameter) or (isinstance(value, torch.Tensor) and "_buffers_" in node.name)


def _has_user_tensors(gm: fx.GraphModule, example_inputs: list) -> bool:
    """Whether dynamo's graph takes any tensor that is not a parameter or buffer."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return any(isinstance(v, torch.Tensor) and not _is_weight(n, v) for n, v in zip(placeholders, example_inputs))


def _program_from_dynamo(gm: fx.GraphModule, example_inputs: list) -> tuple[Program, list[int], list[tuple[str, int]]]:
    """The Program (parameters and buffers as attributes, for the passes), the positions of
    the user's tensors among dynamo's inputs, and (attribute name, position) of each
    parameter and buffer dynamo passes.

    The Program gets a copy of the graph: dynamo's gm shares dynamo's own graph, and dynamo
    builds the call of the compiled function from the placeholders left in it once the
    backend returns, so rewriting it in place would drop the weights from every call."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    names, bound = {}, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if _is_weight(node, value):
            if id(value) not in names:
                names[id(value)] = _qualified_name(node.name)
                bound.append((names[id(value)], position))
    num_inputs = sum(
        1 for n, v in zip(placeholders, example_inputs) if isinstance(v, torch.Tensor) and id(v) not in names
    )
    positions = to_fx_convention(gm, list(example_inputs), names, num_inputs)
    out_spec = pytree.tree_flatten(tuple(range(len(list(gm.graph.nodes)[-1].args[0]))))[1]
    return Program(gm=gm, modules={}, out_spec=out_spec), positions, bound


def _tensors_as_inputs(gm: fx.GraphModule, bound: list[tuple[str, int]]) -> tuple[fx.GraphModule, list[tuple[str, int]]]:
    """A copy of `gm` for lowering whose `bound` attributes are leading inputs again,
    parameters before buffers (aot_autograd's order, so the backward's first outputs are
    the parameters' gradients), and the bound attributes in that order.

    The passes see them as attributes, but they are dynamo's graph inputs: dynamo reuses
    a graph wherever the same code runs (every layer's forward after a graph break) and
    passes that call's weights. Left as attributes, aot_autograd would fix the first
    call's tensors in the compiled function."""
    parameters = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    bound = sorted(bound, key=lambda b: b[0] not in parameters)
    graph, env = fx.Graph(), {}
    inputs = {name: graph.placeholder(name.replace(".", "_")) for name, _ in bound}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in inputs:
            env[node] = inputs[node.target]
            env[node].meta.update(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph), bound  # copies only the attributes still read


def _qualified_name(placeholder: str) -> str:
    """dynamo's l_self_modules_layers_modules_0_modules_moe_parameters_w_ -> layers.0.moe.w"""
    name = re.sub(r"^l_self_", "", placeholder).rstrip("_")
    name = re.sub(r"^(modules|parameters|buffers)_", "", name)
    return re.sub(r"_(modules|parameters|buffers)_", ".", name)
