"""A Program: the graph the passes rewrite, plus what they need to know about its model.

Each pass runs on its own `derive()`d copy and hands it on, so the program before a pass
is still there to diff (`parent`). What passes find is typed (`regions`); what they ask
of the runtime is typed too (`runtime`). Nodes they create carry
`node.meta["commfx"] = {"pass": ..., "purpose": ...}` so dumps show provenance.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .regions import Regions


class PassError(RuntimeError):
    """A pass cannot apply to this graph (the message says why and what to do)."""


@dataclass
class CommSchedule:
    """How the runtime orders collectives (partition_a2a): whether all-to-all pre-empts
    gradient all-reduce, and the all-reduce chunk that bounds a pre-emption's wait."""

    priority: bool = False
    grad_chunk_bytes: int = 0


@dataclass
class RuntimeNeeds:
    """What the rewritten graph needs of the runtime, set by passes, read by the runtime."""

    # parameter -> {"dim", "group", "parts", "replicated_over"[, "layout"]}: the runtime shards it
    shards: dict[str, dict] = field(default_factory=dict)
    reduced_in_graph: list[str] = field(default_factory=list)  # gradients the graph sums itself
    comm_schedule: CommSchedule = field(default_factory=CommSchedule)
    a2a_algorithm: str = "flat"  # flat | hierarchical
    # all-to-all tag prefix (an MoE block's dispatch or combine) -> flat | hierarchical: the
    # algorithm of those all-to-alls, forward and backward (hierarchical_a2a:enabled=auto);
    # the others take a2a_algorithm (runtime.hierarchical_a2a.algorithm_for)
    a2a_sites: dict[str, str] = field(default_factory=dict)
    grad_sync: str = "backward"  # backward | next_forward (deferred into the next step)
    expert_placement: dict[str, dict] = field(default_factory=dict)  # packed block path -> placement spec
    tp_resize: dict | None = None  # the SEMI controller's linears, options and units
    shard_states: dict = field(default_factory=dict)  # shard_states: {"stage": 1|2}; {}: states replicated
    backward_order: str = "graph"  # graph | communicating_first (runtime/backward_order.py)


@dataclass
class Program:
    gm: fx.GraphModule
    modules: dict[str, torch.nn.Module]  # qualified name -> module of the captured model ({} if unknown)
    out_spec: pytree.TreeSpec  # how to rebuild the model's output from the graph's flat outputs
    facts: set[str] = field(default_factory=set)  # e.g. "moe lifted", "expert parallel"
    history: list[str] = field(default_factory=list)
    regions: Regions = field(default_factory=Regions)
    runtime: RuntimeNeeds = field(default_factory=RuntimeNeeds)
    tokens_per_rank: int | None = None  # what cost models assume (the world's largest)
    notes: list[str] = field(default_factory=list)  # what passes chose, and why (commfx dump)
    decisions: dict[str, dict] = field(default_factory=dict)  # pass -> its per-region choices
    rewrites: dict[str, dict[str, int]] = field(default_factory=dict)  # pass -> Pass.evidence
    # The forward's parameter name of each graph input, in placeholder order, and the
    # forward's signature: calls bind (args, kwargs) by name, positional or keyword.
    input_names: list[str] = field(default_factory=list)
    signature: inspect.Signature | None = None
    parent: Program | None = field(default=None, repr=False, compare=False)  # the program before the last pass
    _by_name: dict[str, fx.Node] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def module_at(self, path: str) -> torch.nn.Module | None:
        return self.modules.get(path)

    def derive(self) -> Program:
        """The program a pass rewrites: a copy of the graph (parameters and modules shared),
        regions moved onto the copy, lists and records copied, `parent` this program."""
        graph = fx.Graph(tracer_cls=self.graph._tracer_cls)
        graph._codegen = copy.deepcopy(self.graph._codegen)
        mapping: dict[fx.Node, fx.Node] = {}
        value, old_output = graph.graph_copy(self.graph, mapping, return_output_node=True)
        mapping[old_output] = graph.output(value, type_expr=old_output.type)
        mapping[old_output].meta = copy.copy(old_output.meta)
        _continue_names(graph, self.graph)
        gm = fx.GraphModule(self.gm, graph, self.gm.__class__.__name__)
        gm.meta = dict(getattr(self.gm, "meta", {}))
        return dataclasses.replace(
            self, gm=gm, facts=set(self.facts), history=list(self.history), regions=self.regions.remapped(mapping),
            runtime=copy.deepcopy(self.runtime), notes=list(self.notes), decisions=copy.deepcopy(self.decisions),
            rewrites=dict(self.rewrites), parent=self,
        )

    def node(self, name: str) -> fx.Node:
        """The graph's node called `name` (KeyError if none): the one lookup by name passes
        use. The index is rebuilt when the graph changed under it."""
        found = self._by_name.get(name)
        if found is None or found.name != name or found.graph is not self.graph or found._erased:
            self._by_name.clear()
            self._by_name.update((n.name, n) for n in self.graph.nodes)
            found = self._by_name[name]
        return found


def _continue_names(copy_: fx.Graph, original: fx.Graph) -> None:
    """New nodes of `copy_` take the names they would have taken in `original` (whose
    namespace remembers erased names too), so a pass names its nodes the same either way."""
    new, old = copy_._graph_namespace, original._graph_namespace
    new._used_names |= old._used_names
    new._base_count = dict(old._base_count)


# node.meta key: the node's traced value is whole, but each rank computes 1/parts of it
# (tensor_parallel's split values and row linears); cost models divide by it.
TP_PARTS = "commfx_tp_parts"


def stamp(node: fx.Node, pass_name: str, purpose: str) -> fx.Node:
    """Record which pass made `node` and why (shown by `commfx dump`)."""
    node.meta["commfx"] = {"pass": pass_name, "purpose": purpose}
    return node


def module_path(node: fx.Node) -> str | None:
    """The innermost module a node was traced in, as a qualified name ('' for the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    return normalise_module_path(path)


def module_paths(node: fx.Node) -> list[tuple[str, type]]:
    stack = node.meta.get("nn_module_stack") or {}
    return [(normalise_module_path(path), cls) for path, cls in stack.values()]


def normalise_module_path(path: str) -> str:
    """dynamo's "L['self'].layers[0]._modules['moe']" -> "layers.0.moe"."""
    import re

    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")
