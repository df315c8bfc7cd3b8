"""One hidden layer for the experts' forward and backward, under compiled regions.

`expert_ffn_backward` recomputes the hidden layer x @ gate_up rather than saving it: an op
cannot hand its backward a value it does not return. Opened into its aten form around the
grouped GEMMs (`ops/decompositions.py`), the joint graph holds that product twice, with the
same operands; merging the two (and the casts of the weights both read) lets the partitioner
save the forward's product, so the backward runs one grouped GEMM fewer per expert call, at
the memory of one [rows, 2 * expert hidden] activation (what eager autograd saves). A GEMM is
never recomputed (`remat.save_foreign_ops`), so an activation memory budget does not undo it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

MERGEABLE = (torch.ops.commfx.grouped_mm.default, torch.ops.aten._to_copy.default)


def merge_repeated_gemms(joint: fx.GraphModule) -> int:
    """Replace each repeated call of a grouped GEMM (or a cast) on the same operands by the
    first; returns how many were merged."""
    first: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(joint.graph.nodes):
        if node.op != "call_function" or node.target not in MERGEABLE:
            continue
        key = (node.target, node.args, tuple(sorted(node.kwargs.items(), key=lambda item: item[0])))
        try:
            hash(key)
        except TypeError:  # an unhashable argument (a list of sizes): leave it
            continue
        if key in first:
            node.replace_all_uses_with(first[key])
            joint.graph.erase_node(node)
            merged += 1
        else:
            first[key] = node
    if merged:
        joint.recompile()
    return merged


def merging_gemms(partition):
    """`partition` (an aot_autograd partition function) run on the joint graph with its
    repeated grouped GEMMs merged."""

    def partition_merged(joint: fx.GraphModule, joint_inputs, **kwargs):
        merge_repeated_gemms(joint)
        return partition(joint, joint_inputs, **kwargs)

    return partition_merged
