"""Functions the fp8 dispatch tests run on every rank (imported by the worker processes)."""

import dataclasses

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.verify import split_batch

# gpt-moe-tiny widened to one full scale block (hidden 128), as the bench model is.
MODEL = {"hidden_size": 128, "expert_hidden": 64}


def dispatch_bytes(rank: int, world_size: int, passes: str, codecs: tuple[str, ...] = ("rows", "fp8")) -> dict:
    """One step of `passes` with dispatch as each of `codecs` says (same model, batch and routing):
    every all-to-all record of the forward and of the backward, the scheduler's total
    all-to-all bytes, the loss and the gradients."""
    out = {}
    for codec in codecs:
        model, (ids,) = load_model("gpt-moe-tiny", **MODEL)
        local = split_batch(ids, world_size, rank)
        plan = Plan.from_cli(passes.replace("expert_parallel", f"expert_parallel:dispatch={codec}"), world_size=world_size)
        dm = distribute(model, dataclasses.replace(plan, precision="bf16"), (local,))
        dm.scheduler.records = []
        dm.scheduler.stats.reset()
        logits = dm(local)
        forward = list(dm.scheduler.records)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), local[:, 1:].reshape(-1))
        loss.backward()
        backward = dm.scheduler.records[len(forward):]
        dm.scheduler.records = None
        stats = dm.scheduler.stats.as_dict()["all_to_all"]
        out[codec] = {
            "forward": [_describe(r, rank) for r in forward if r.kind == "all_to_all"],
            "backward": [_describe(r, rank) for r in backward if r.kind == "all_to_all"],
            "a2a_bytes": stats["intra_node_bytes"] + stats["inter_node_bytes"],
            "loss": loss.item(),
            "grads": {n: p.grad.float().clone() for n, p in dm.module.named_parameters() if p.grad is not None},
        }
    return out


def _describe(record, rank: int) -> dict:
    """A record's dtype, rows and the bytes it sends to other ranks (the scheduler counts no
    rows a rank keeps; in a 2-rank world the ep group is the world)."""
    numel = 1
    for size in record.row_shape:
        numel *= size
    rows = sum(record.send_rows) - record.send_rows[rank]
    return {
        "dtype": str(record.dtype),
        "rows": list(record.send_rows),
        "width": numel,
        "bytes": rows * numel * torch.empty((), dtype=record.dtype).element_size(),
    }
