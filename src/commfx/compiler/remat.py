"""Activation recomputation: how aot_autograd splits the joint graph under `Plan(activation_memory_budget=...)`.

Without a budget the split is aot_autograd's default partition: the forward saves every
value the backward reads. With a budget b in (0, 1] it is the min-cut rematerialisation
partition (`min_cut_rematerialization_partition`, Inductor's), run with
`torch._functorch.config.activation_memory_budget = b` patched for that call only: the
backward recomputes cheap values, and as b falls, costlier ones (chosen by a knapsack on
FLOPs), so the saved bytes above the graph's inputs fall to about b of the min-cut's own.

Ops outside aten and prims (commfx's canonical ops: collectives the runtime's scheduler
issues, ops with per-step state, kernels the partitioner cannot cost) are saved, never
recomputed: a recomputed all-to-all would be an extra collective in the backward. The
partitioner already saves `_c10d_functional` collectives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from ..cost.flops import hint

RECOMPUTABLE_NAMESPACES = ("aten", "prims")


def partition_fn(activation_memory_budget: float | None) -> Callable:
    """The partition function aot_autograd gets for this budget (None: its default partition)."""
    if activation_memory_budget is None:
        return default_partition
    if not 0 < activation_memory_budget <= 1:
        raise ValueError(f"activation_memory_budget must be in (0, 1], got {activation_memory_budget}")
    return functools.partial(_budgeted_partition, budget=float(activation_memory_budget))


def _budgeted_partition(joint_module: fx.GraphModule, joint_inputs, *, budget: float, **kwargs):
    save_foreign_ops(joint_module)
    with functorch_config.patch(activation_memory_budget=budget):
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def recomputable(target) -> bool:
    """Whether the partitioner may recompute a call of `target`: anything but an op outside
    aten and prims (a torch function in a dynamo graph counts as the aten ops it becomes)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in RECOMPUTABLE_NAMESPACES
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] in RECOMPUTABLE_NAMESPACES
    return True


def save_foreign_ops(joint_module: fx.GraphModule) -> int:
    """Mark every op outside aten and prims must-save (a user's own checkpoint policy kept);
    returns how many were marked."""
    marked = 0
    for node in joint_module.graph.nodes:
        if node.op != "call_function" or recomputable(node.target) or "recompute" in node.meta:
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        marked += 1
    return marked


@dataclass(frozen=True)
class Saved:
    """What a forward graph hands its backward, beyond the inputs both hold anyway."""

    tensors: int  # distinct activations saved (views of one value count once)
    bytes: int  # their bytes, sizes at the traced hints


def saved_activations(forward: fx.GraphModule, backward: fx.GraphModule) -> Saved:
    """The activations the forward saves for the backward: the backward's inputs other than
    tangents, each followed through views to the value that holds its storage, those that
    are the forward's own inputs (parameters, the batch) left out."""
    nodes = {node.name: node for node in forward.graph.nodes}
    bases: dict[str, int] = {}
    for node in backward.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents") or node.name not in nodes:
            continue
        base = _storage_base(nodes[node.name])
        value = base.meta.get("val")
        if base.op == "placeholder" or not isinstance(value, torch.Tensor):
            continue
        bases[base.name] = math.prod(hint(s) for s in value.shape) * value.element_size()
    return Saved(len(bases), sum(bases.values()))


def _storage_base(node: fx.Node) -> fx.Node:
    """The node whose value `node`'s aliases (itself unless it is a view)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view and node.args:
        source = node.args[0]
        if not isinstance(source, fx.Node):
            break
        node = source
    return node
