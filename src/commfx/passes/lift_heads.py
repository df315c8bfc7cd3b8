"""lift's LM-head recogniser: a linear over the vocabulary whose logits feed only the loss.

The pattern (what `F.cross_entropy(lm_head(h).flatten(0, 1), labels.flatten())` and its
view/reshape spellings capture as):

    logits = linear(h, W)            W: a 2-D parameter [V, H], no bias
    flat   = logits.view/reshape/flatten(...)   (any number, last dim V kept, one user each)
    loss   = cross_entropy(flat, labels, ignore_index=i, reduction="mean"|"sum")

Such a head can be split over the vocabulary (`split_embedding_comm`, head=shard): only the
loss leaves it. The graph is not changed here; each head is recorded in
`program.regions.lm_heads`, and a cross-entropy over a linear that does not fit
(its logits used elsewhere, a tied weight, class weights, label smoothing) in
`program.regions.kept_heads` with the reason, which `commfx dump` shows.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.program import Program
from ..compiler.regions import EmbeddingTable, LMHead
from .lift_embeddings import attribute

CROSS_ENTROPY = inspect.signature(F.cross_entropy)
LINEAR_CALLS = (F.linear, torch._C._nn.linear)
SHAPE_METHODS = {"view", "reshape", "flatten"}
SHAPE_FUNCTIONS = {torch.reshape, torch.flatten}


def lift_heads(program: Program, tables: list[EmbeddingTable]) -> tuple[list[LMHead], list[str]]:
    """(heads that could be vocabulary-parallel, cross-entropies over a linear kept and why)."""
    heads, kept = [], []
    table_params = {id(attribute(program, t.weight)) for t in tables}
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not F.cross_entropy:
            continue
        bound = CROSS_ENTROPY.bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        args = bound.arguments
        linear, chain = _linear_behind(args["input"])
        if linear is None:
            continue
        weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        value = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
        tied = isinstance(weight, fx.Node) and weight.op == "get_attr" and id(attribute(program, weight.target)) in table_params
        why = _why_not(args, linear, chain, weight, bias, value, tied)
        if why:
            kept.append(f"{node.name}: {why}")
            continue
        heads.append(LMHead(weight.target, value.shape[0], value.shape[1], node, linear, int(args["ignore_index"]), args["reduction"]))
    return heads, kept


def _linear_behind(node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The linear whose logits reach `node` through shape ops only, and those shape ops."""
    chain = []
    while isinstance(node, fx.Node) and _is_shape_op(node):
        chain.append(node)
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in LINEAR_CALLS:
        return node, chain
    return None, chain


def _is_shape_op(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in SHAPE_METHODS) or (node.op == "call_function" and node.target in SHAPE_FUNCTIONS)


def _why_not(args, linear, chain, weight, bias, value, tied: bool) -> str:
    """Why this cross-entropy's head cannot be split over the vocabulary ('' when it can)."""
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and isinstance(value, torch.Tensor) and value.dim() == 2):
        return "the head's weight is not a 2-D parameter"
    if bias is not None:
        return f"{weight.target} has a bias"
    if tied or any(u is not linear for u in weight.users):
        return f"{weight.target} is used elsewhere too (a tied embedding): its gradient is dense data parallelism's"
    if any(len(n.users) != 1 for n in (linear, *chain)):
        return "its logits are used by more than the loss (an output of the model?): a split head would have to gather them"
    if any(args[k] is not None for k in ("weight", "size_average", "reduce")) or args["label_smoothing"] != 0.0:
        return "cross_entropy with class weights, label smoothing or legacy reduction flags"
    if args["reduction"] not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} (per-token losses leave the head)"
    logits = args["input"].meta.get("example_value")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or any(
        n.meta.get("example_value") is None or n.meta["example_value"].shape[-1] != value.shape[0] for n in (linear, *chain)
    ):
        return "the logits are not flattened to [tokens, vocabulary] with the vocabulary last"
    return ""
