"""microbatch_overlap: cut the batch into micro-batches and interleave them, so that one
micro-batch's all-to-all overlaps another's compute, attention included.

partition_a2a overlaps a layer's all-to-all with the same layer's experts, but each layer's
first dispatch chunk still waits for the whole batch's attention and router, and its last
combine chunk holds back the next layer's attention: on the wire, those are gaps that no
chunking of the MoE region can fill. Run two micro-batches side by side instead (DeepSeek-V3's
two-micro-batch overlap) and micro-batch 0's dispatch flies while micro-batch 1 computes its
attention, micro-batch 1's combine while micro-batch 0 goes on to the next layer.

The pass copies every node that depends on the batch once per micro-batch (parameters and
batch-free nodes stay shared) on `tensor_split` slices of the batched inputs, and orders the
copies by communication phase: phase p of a node is the number of all-to-alls on its longest
path from the inputs, and the graph runs phase 0 of micro-batch 0, then of micro-batch 1,
then phase 1 of each, ... The outputs are the micro-batches' outputs concatenated on the
batch dimension. Autograd runs backward in reverse creation order, so backward interleaves
the same way. Count exchanges move to the `ctl` lane, ahead of all-to-all, so that one
micro-batch's counts never queue behind the other's rows.

Tensor-parallel all-reduces are copied per micro-batch like any node and run in their
micro-batch's turn (phases count all-to-alls only, so they are not yet overlapped).

Lossless where the model treats sequences independently (tested in float64): the pass
rejects outputs without the batch dimension (a loss), nodes whose shapes drop it (a
reduction over the batch) and capacity-limited routing (capacity counts a whole batch).
Its check reads shapes; `commfx verify` proves a model.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..compiler.program import Program
from ..compiler.rewrite import Rewriter
from ..plan import Plan, PlanError, register_priority_class
from .base import INTERLEAVED, Pass, PassError, register

commfx = torch.ops.commfx
PASS = "microbatch_overlap"
CONTROL_CLASS = "ctl"
register_priority_class(CONTROL_CLASS, -10, "count exchanges of overlapped micro-batches: ahead of the other's rows (microbatch_overlap)", groups=("ep",))

# Facts of graphs whose state or statistics span the whole batch, or that this pass does not handle yet.
REFUSED = {
    "pipeline split": "pipeline stages already run micro-batches",
    "locality gate": "its capacity floor is measured on the whole batch",
    "embedding comm": "its embedding exchange is not interleaved yet",
    "capacity routing": "capacity is counted per micro-batch, so other tokens would be dropped than without it; "
                        "use dropless routing (capacity_factor=0)",
}


@register(PASS, rewrites="moe_blocks", requires="expert parallel", ensures=INTERLEAVED, refuses=REFUSED)
class MicrobatchOverlap(Pass):
    """Interleave micro-batches so one's all-to-all overlaps another's attention and experts.

    (DeepSeek-V3 technical report, 2024: two-micro-batch overlap.)
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        n: int = 2  # micro-batches per rank

    @classmethod
    def micro_batches(cls, options: Options) -> int:
        return options.n

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.n < 2:
            raise PlanError(f"microbatch_overlap n must be >= 2 (micro-batches per rank), got {options.n}")

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        graph = program.graph
        batched = _batched_inputs(graph, program.input_names)
        symbol = _batch_symbol(_value(batched[0]))
        depends = _batch_dependent(graph, batched, symbol)
        _check_separable(graph, depends, symbol)
        phase = _phases(graph)
        rw = Rewriter(program, PASS, graph=fx.Graph())  # the interleaved copy, installed by finish
        _interleave(rw, graph, batched, depends, phase, options.n)
        rw.finish()
        program.notes.append(
            f"{PASS}: {options.n} micro-batches per rank, interleaved by all-to-all phase "
            f"({max(phase.values(), default=0) + 1} phases); count exchanges on the {CONTROL_CLASS!r} lane"
        )
        return True


def _is_a2a(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is commfx.all_to_all.default


def _value(node: fx.Node):
    """The fake value capture recorded for `node` (dynamo names it example_value)."""
    return node.meta.get("val", node.meta.get("example_value"))


def _batch_symbol(value) -> object | None:
    """The symbol of a fake tensor's first dimension, or None when it is a plain int."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or isinstance(value.shape[0], int):
        return None
    return value.shape[0].node.expr


def _batched_inputs(graph: fx.Graph, names: list[str]) -> list[fx.Node]:
    """The graph inputs whose first dimension is the batch (that of the first tensor input)."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and isinstance(_value(n), torch.Tensor)]
    if not inputs:
        raise PassError("microbatch_overlap: the graph has no tensor inputs to cut into micro-batches")
    batch = _batch_symbol(_value(inputs[0]))
    if batch is None and _value(inputs[0]).dim() and _value(inputs[0]).shape[0] == 1:
        raise PassError(
            f"microbatch_overlap: this rank's batch is 1 sequence ({_input_name(graph, inputs[0], names)}), which cannot be cut into micro-batches; "
            "give every rank at least 2 sequences (the global batch >= 2 x the data-parallel size) or leave microbatch_overlap out"
        )
    if batch is None:
        raise PassError(
            f"microbatch_overlap: input {_input_name(graph, inputs[0], names)} has a fixed batch size ({tuple(_value(inputs[0]).shape)}); "
            "it needs a graph captured with a symbolic batch (commfx's capture does this; with torch.compile, mark the batch "
            f"dimension dynamic first: torch._dynamo.mark_dynamic({_input_name(graph, inputs[0], names)}, 0))"
        )
    return [n for n in inputs if _batch_symbol(_value(n)) == batch]


def _input_name(graph: fx.Graph, node: fx.Node, names: list[str]) -> str:
    """The forward's name for a graph input (dynamo calls it `l_kwargs_input_ids_`)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = placeholders.index(node)
    if index < len(names):
        return names[index]
    return re.sub(r"^l_((kw)?args_)?|_$", "", node.name)  # the torch.compile door: dynamo's own names


def _batch_dependent(graph: fx.Graph, batched: list[fx.Node], symbol) -> set[fx.Node]:
    """Nodes computed from the batched inputs; a size that is not the batch's (the sequence
    length of `input_ids`) is not, and stays shared."""
    depends = set(batched)
    for node in graph.nodes:
        if node.op == "output" or not any(i in depends for i in node.all_input_nodes):
            continue
        value = _value(node)
        if isinstance(value, torch.SymInt) and symbol not in value.node.expr.free_symbols:
            continue
        depends.add(node)
    return depends


def _has_symbol(value, symbol) -> bool:
    if isinstance(value, torch.Tensor):
        return any(not isinstance(s, int) and symbol in s.node.expr.free_symbols for s in value.shape)
    if isinstance(value, (tuple, list)):
        return any(_has_symbol(v, symbol) for v in value)
    return False


def _check_separable(graph: fx.Graph, depends: set[fx.Node], symbol) -> None:
    """Reject what a micro-batch cannot compute alone: a tensor whose shape loses the batch
    symbol (a reduction over it) and outputs without the batch as their first dimension."""
    for node in graph.nodes:
        value = _value(node)
        if node not in depends or node.op == "placeholder" or not isinstance(value, (torch.Tensor, tuple, list)):
            continue
        tensors = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        if tensors and not _has_symbol(value, symbol):
            raise PassError(
                f"microbatch_overlap: {node.name} ({node.format_node()[:120]}) computes a shape without the batch "
                f"dimension from batched inputs, a reduction over the whole batch that micro-batches would compute apart; "
                "compute it outside the model or leave microbatch_overlap out"
            )
    output = next(n for n in graph.nodes if n.op == "output")
    for index, leaf in enumerate(pytree.tree_leaves(output.args[0])):
        if isinstance(leaf, fx.Node) and leaf in depends and _batch_symbol(_value(leaf)) != symbol:
            raise PassError(
                f"microbatch_overlap: output {index} ({leaf.name}) does not have the batch as its first dimension "
                "(a loss or a statistic over the batch?); return per-sequence outputs and reduce them outside the model, "
                "or leave microbatch_overlap out"
            )


def _phases(graph: fx.Graph) -> dict[fx.Node, int]:
    """Phase of a node: the most all-to-alls on any path to it from the inputs."""
    phase: dict[fx.Node, int] = {}
    for node in graph.nodes:
        phase[node] = max((phase[i] + _is_a2a(i) for i in node.all_input_nodes), default=0)
    return phase


def _interleave(rw: Rewriter, graph: fx.Graph, batched: list[fx.Node], depends: set[fx.Node], phase: dict[fx.Node, int], n: int) -> fx.Graph:
    body = [node for node in graph.nodes if node.op not in ("placeholder", "output")]
    position = {node: i for i, node in enumerate(graph.nodes)}
    # shared nodes of a phase first, then each micro-batch's nodes of that phase, in graph order
    order = sorted(body, key=lambda node: (phase[node], node in depends, position[node]))

    new = rw.graph
    shared: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            shared[node] = new.node_copy(node)
            rw.follow(node, shared[node])
    micro: list[dict[fx.Node, fx.Node]] = [{} for _ in range(n)]
    for node in batched:
        split = rw.call(torch.tensor_split, (shared[node], n), purpose=f"cut {node.name} into {n} micro-batches")
        for i in range(n):
            micro[i][node] = rw.call(operator.getitem, (split, i), purpose=f"micro-batch {i + 1}/{n}")

    for _, nodes in itertools.groupby(order, key=phase.__getitem__):
        in_phase = list(nodes)
        for node in in_phase:
            if node not in depends:
                shared[node] = new.node_copy(node, lambda x: shared[x])
                rw.follow(node, shared[node])
        for i in range(n):
            env = micro[i]
            for node in in_phase:
                if node in depends:
                    env[node] = _copy(rw, node, lambda x, env=env: env.get(x, shared.get(x)), i, n)

    output = next(node for node in graph.nodes if node.op == "output")

    def joined(leaf):
        if isinstance(leaf, fx.Node) and leaf in depends:
            return rw.call(torch.cat, ([micro[i][leaf] for i in range(n)], 0), purpose="micro-batches' outputs, joined on the batch")
        return shared[leaf] if isinstance(leaf, fx.Node) else leaf

    new.output(pytree.tree_map(joined, output.args[0]))
    new.lint()
    return new


def _copy(rw: Rewriter, node: fx.Node, lookup, i: int, n: int) -> fx.Node:
    """Micro-batch i's copy of `node`. Micro-batch 0 keeps the name and takes the node's place
    in the program's regions; a copy's shapes are a micro-batch's, so the whole batch's shape
    meta stays behind."""
    args, kwargs = fx.map_arg(node.args, lookup), fx.map_arg(node.kwargs, lookup)
    if _is_a2a(node):
        x, send, recv, group, *rest = args
        priority = rest[0] if rest else "a2a"
        tag = rest[1] if len(rest) > 1 else ""
        args = (x, send, recv, group, priority, f"{tag} mb {i + 1}/{n}".strip())
    elif node.op == "call_function" and node.target is commfx.exchange_counts.default:
        args = (*args[:3], CONTROL_CLASS)
    return rw.copy(
        node, args, kwargs, name=f"{node.name}_mb{i}" if i else node.name, drop_meta=("val", "example_value", "tensor_meta"),
        stands_for=i == 0,
    )
