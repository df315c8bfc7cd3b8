"""FLOPs of a traced node from its shapes: what balance_by_flops (pipeline_split) weighs
stages by."""

from __future__ import annotations

import torch
import torch.fx as fx


def node_flops(node: fx.Node) -> float:
    """A matmul-family node's FLOPs from its traced shapes (2 x output elements x the
    contracted size); other nodes count as free."""
    name = getattr(node.target, "__name__", str(node.target))
    value = node.meta.get("example_value")
    first = node.args[0].meta.get("example_value") if node.args and isinstance(node.args[0], fx.Node) else None
    if _is_sharded_head(name):
        # the sharded LM head: every rank's tokens (gathered over the `parts` ranks) against this
        # rank's 1/parts of the rows; the graph's parameter is full-size: as many FLOPs as the
        # dense head on this rank's tokens
        logits = _head_logits(node)
        return 2.0 * logits * hint(_traced(node.args[1]).shape[1]) if logits else 0.0
    if node.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor):
        return 0.0
    if name in ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm") and isinstance(first, torch.Tensor):
        return 2.0 * _numel(value) * hint(first.shape[-1])
    if name == "scaled_dot_product_attention" and isinstance(first, torch.Tensor):
        return 4.0 * _numel(first) * hint(first.shape[-2])
    if name.startswith("expert_ffn"):
        gate_up = node.args[2].meta.get("example_value") if isinstance(node.args[2], fx.Node) else None
        if isinstance(gate_up, torch.Tensor) and isinstance(first, torch.Tensor):
            return 2.0 * hint(first.shape[0]) * 1.5 * hint(gate_up.shape[1]) * hint(gate_up.shape[2])
    return 0.0


def node_bytes(node: fx.Node) -> float:
    """Memory traffic of a pass's node that has no traced value, where it is known: the
    sharded LM head writes its logits and reads them twice (log-sum-exp, the target's
    logit), 4-byte floats; 0 otherwise."""
    name = getattr(node.target, "__name__", str(node.target))
    return 3.0 * 4 * _head_logits(node) if _is_sharded_head(name) else 0.0


def _is_sharded_head(name: str) -> bool:
    return name.startswith("vocab_parallel_loss") and not name.startswith("vocab_parallel_loss_backward")


def _head_logits(node: fx.Node) -> int:
    """Logits a rank of the sharded head computes: its share of the rows for every rank's
    tokens, as many as the dense head's on this rank's tokens (0 if the shapes are unknown)."""
    weight, tokens = _traced(node.args[1]), _traced(node.args[0])
    if not (isinstance(weight, torch.Tensor) and isinstance(tokens, torch.Tensor)):
        return 0
    return (_numel(tokens) // hint(weight.shape[1])) * hint(weight.shape[0])


def _traced(node, hops: int = 4):
    """A node's traced value, or that of the first input up the chain that has one (a pass may
    add views without values): the same elements, whatever the shape."""
    for _ in range(hops):
        if not isinstance(node, fx.Node):
            return None
        value = node.meta.get("example_value", node.meta.get("val", getattr(node, "_param", None)))
        if value is not None:
            return value
        node = node.args[0] if node.args else None
    return None


def hint(size) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


def _numel(t: torch.Tensor) -> int:
    n = 1
    for size in t.shape:
        n *= hint(size)
    return n
