"""A Program: the graph the passes rewrite, plus what they need to know about its model.

Passes mutate `gm` in place and record what they did in `history`; nodes they create
carry `node.meta["commfx"] = {"pass": ..., "purpose": ...}` so dumps show provenance.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree


@dataclass
class Program:
    gm: fx.GraphModule
    modules: dict[str, torch.nn.Module]  # qualified name -> module of the captured model ({} if unknown)
    out_spec: pytree.TreeSpec  # how to rebuild the model's output from the graph's flat outputs
    facts: set[str] = field(default_factory=set)  # e.g. "moe lifted", "expert parallel"
    history: list[str] = field(default_factory=list)
    # Facts passes hand to the runtime: parameter shards, group names, MoE block list, ...
    annotations: dict[str, Any] = field(default_factory=dict)
    # The forward's parameter name of each graph input, in placeholder order, and the
    # forward's signature: calls bind (args, kwargs) by name, positional or keyword.
    input_names: list[str] = field(default_factory=list)
    signature: inspect.Signature | None = None
    _by_name: dict[str, fx.Node] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def module_at(self, path: str) -> torch.nn.Module | None:
        return self.modules.get(path)

    def node(self, name: str) -> fx.Node:
        """The graph's node called `name` (KeyError if none): the one lookup by name passes
        use. The index is rebuilt when the graph changed under it."""
        found = self._by_name.get(name)
        if found is None or found.name != name or found.graph is not self.graph or found._erased:
            self._by_name.clear()
            self._by_name.update((n.name, n) for n in self.graph.nodes)
            found = self._by_name[name]
        return found


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
