"""How a dispatch all-to-all is built: rows as they are, or as float8 bytes (DeepEP's recipe).

expert_parallel:dispatch=fp8 sets a block's codec; pack_experts and partition_a2a, which
rebuild the dispatch exchange, build it through `dispatch_all_to_all` so the codec follows
the block. The combine all-to-all is never encoded. See ops/fp8_dispatch.py for the format,
the straight-through backward and the error bound.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..plan import Plan, PlanError

commfx = torch.ops.commfx
CODECS = ("rows", "fp8")  # rows: the rows' own dtype (bf16 under --precision bf16)


def check_codec(plan: Plan, codec: str) -> None:
    if codec not in CODECS:
        raise PlanError(f"expert_parallel dispatch must be one of {', '.join(CODECS)}, got {codec!r}")
    if codec == "fp8" and plan.precision != "bf16":
        raise PlanError(
            "expert_parallel:dispatch=fp8 quantises bf16 token rows (DeepEP's recipe: fp8 dispatch, bf16 combine and "
            f"gradients), but the plan's precision is {plan.precision}; add --precision bf16 (Plan(precision='bf16'))"
        )


def dispatch_all_to_all(make, rows: fx.Node, send: fx.Node, recv: fx.Node, group: str, priority: str, tag: str,
                        codec: str, purpose: str, meta: fx.Node | None = None) -> fx.Node:
    """The node holding the received rows: one all-to-all, or encode -> all-to-all of bytes ->
    decode under fp8 (`meta`: the routing metadata attach_meta put in the rows' last columns,
    carried bit for bit)."""
    if codec != "fp8":
        return make(commfx.all_to_all.default, (rows, send, recv, group, priority, tag), purpose)
    payload = make(commfx.fp8_encode.default, (rows, meta), "fp8 e4m3 rows, a float32 scale per 128 values, as bytes")
    wire = make(commfx.all_to_all.default, (payload, send, recv, group, priority, tag), f"{purpose} (fp8 bytes)")
    return make(
        commfx.fp8_decode.default, (wire, rows, send, recv, group, priority, tag, meta),
        "dequantise the rows before the experts (backward: bf16, straight through)",
    )


def retag(received: fx.Node, priority: str, tag: str) -> None:
    """Give a dispatch (either form) or combine all-to-all its priority class and trace tag."""
    if received.target is commfx.fp8_decode.default:
        received.args = (*received.args[:5], priority, tag, *received.args[7:])
        received = received.args[0]
    received.args = (*received.args[:4], priority, tag, *received.args[6:])
