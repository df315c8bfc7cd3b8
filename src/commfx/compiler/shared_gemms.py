"""One hidden layer for the experts' forward and backward, under compiled regions.

`expert_ffn_backward` recomputes the hidden layer x @ gate_up rather than saving it: an op
cannot hand its backward a value it does not return. Opened into its aten form around the
grouped GEMMs (`ops/decompositions.py`), the joint graph holds that product twice, with the
same operands (packed_expert_ffn's backward: the same layout of its rows, computed again);
merging the two (and the casts of the weights both read) lets the partitioner
save the forward's product, so the backward runs one grouped GEMM fewer per expert call, at
the memory of one [rows, 2 * expert hidden] activation (what eager autograd saves). A GEMM is
never recomputed (`remat.save_foreign_ops`), so an activation memory budget does not undo it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

MERGEABLE = (torch.ops.commfx.grouped_mm.default, torch.ops.aten._to_copy.default)
_UNINITIALISED = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.new_empty}
_MERGED = "commfx_merged_into_first"
_NONDETERMINISTIC = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


def merge_repeated_gemms(joint: fx.GraphModule) -> int:
    """Replace each repeated call of a grouped GEMM (or a cast) by the first; returns how many
    nodes were merged. Repeated means the same computation of the same values: its operands
    the same nodes, or the same pure aten computations of them (packed_expert_ffn's backward
    lays its rows out again: a sort, counts, a gather), which are merged with it, so what else
    reads them (the backward's gathers) reads the forward's too. Nothing else is merged."""
    same = _value_numbers(joint.graph)
    merged: list[fx.Node] = []
    for node in list(joint.graph.nodes):
        if node.op == "call_function" and node.target in MERGEABLE and same[node] is not node:
            _merge_cone(node, same, merged)
    for node in reversed(merged):
        if not node.users:
            joint.graph.erase_node(node)
    if merged:
        joint.recompile()
    return len(merged)


def _value_numbers(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node -> the first node computing the same value (itself unless it is a pure call,
    or a grouped GEMM, whose target and operands' first nodes an earlier node shares)."""
    first: dict[tuple, fx.Node] = {}
    same: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        same[node] = node
        if node.op != "call_function" or not _pure(node.target):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: same[n])
        key = (node.target, _hashable(args), _hashable(kwargs))
        try:
            same[node] = first.setdefault(key, node)
        except TypeError:  # an argument that does not hash: this node stays itself
            pass
    return same


def _hashable(value):
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, _hashable(v)) for k, v in value.items()))
    return (type(value).__name__, value)  # 1 and 1.0 and True are different arguments


def _pure(target) -> bool:
    """Whether two calls of `target` on the same arguments have the same value."""
    if target is operator.getitem or target in MERGEABLE:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    return not (target._schema.is_mutable or target.overloadpacket in _UNINITIALISED or any(t in target.tags for t in _NONDETERMINISTIC))


def _merge_cone(node: fx.Node, same: dict[fx.Node, fx.Node], merged: list[fx.Node]) -> None:
    """Replace `node` and the nodes it reads that repeat an earlier computation by their firsts."""
    stack = [node]
    while stack:
        current = stack.pop()
        if same[current] is current or current.meta.get(_MERGED):
            continue
        current.meta[_MERGED] = True
        stack.extend(current.all_input_nodes)
        current.replace_all_uses_with(same[current])
        merged.append(current)


def merging_gemms(partition):
    """`partition` (an aot_autograd partition function) run on the joint graph with its
    repeated grouped GEMMs merged."""

    def partition_merged(joint: fx.GraphModule, joint_inputs, **kwargs):
        merge_repeated_gemms(joint)
        return partition(joint, joint_inputs, **kwargs)

    return partition_merged
