"""Functions the mixed-precision tests run on every rank (imported by the worker processes)."""

import dataclasses

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.verify import split_batch


def bytes_and_master_weights(rank: int, world_size: int) -> dict:
    """The scheduler's exact bytes of one step under fp32 and under bf16 (same model, same
    batch), split into token rows (floating all-to-alls) and the rest; and, under bf16, the
    dtypes of the parameters, their gradients and the rows after an AdamW step; "bf16 reduce":
    bf16 with gradients all-reduced in bf16 (Plan.grad_reduce_dtype), and the reduced gradients."""
    out = {}
    for run, precision, reduce in (("fp32", "fp32", "fp32"), ("bf16", "bf16", "fp32"), ("bf16 reduce", "bf16", "bf16")):
        model, (ids,) = load_model("gpt-moe-tiny")
        local = split_batch(ids, world_size, rank)
        plan = Plan.from_cli("lift,expert_parallel", world_size=world_size)
        plan = dataclasses.replace(plan, precision=precision, grad_reduce_dtype=reduce)
        dm = distribute(model, plan, (local,))
        optimizer = torch.optim.AdamW(dm.parameters(), lr=1e-2)
        before = {n: p.detach().clone() for n, p in dm.module.named_parameters()}
        dm.scheduler.records = []
        dm.scheduler.stats.reset()
        logits = dm(local)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1)).backward()
        records = dm.scheduler.records
        dm.scheduler.records = None
        rows = [r for r in records if r.kind == "all_to_all" and r.dtype.is_floating_point]
        stats = dm.scheduler.stats.as_dict()
        grads = {n: str(p.grad.dtype) for n, p in dm.module.named_parameters() if p.grad is not None}
        reduced = {n: p.grad.clone() for n, p in dm.module.named_parameters() if p.grad is not None}
        optimizer.step()
        out[run] = {
            "grads": reduced,
            "a2a_bytes": stats["all_to_all"]["intra_node_bytes"] + stats["all_to_all"]["inter_node_bytes"],
            "a2a_row_dtypes": sorted({str(r.dtype) for r in rows}),
            "a2a_rows": [r.send_rows for r in rows],
            "a2a_row_bytes": sum(_sent(r, rank) for r in rows),
            "other_a2a_bytes": sum(_sent(r, rank) for r in records if r.kind == "all_to_all" and r not in rows),
            "grad_all_reduce_bytes": stats.get("grad_all_reduce", {}).get("intra_node_bytes", 0),
            "grad_dtypes": sorted(set(grads.values())),
            "param_dtypes": sorted({str(p.dtype) for p in dm.parameters()}),
            "stepped": sum(int(not torch.equal(before[n], p.detach())) for n, p in dm.module.named_parameters()),
            "loss_finite": bool(torch.isfinite(logits).all()),
        }
    return out


def _sent(record, rank: int) -> int:
    """Bytes a record sends to other ranks (the scheduler counts no rows a rank keeps; the
    ep group of a 2-rank world is the world, so a rank's index in it is its rank)."""
    numel = 1
    for size in record.row_shape:
        numel *= size
    rows = sum(record.send_rows) - record.send_rows[rank]
    return rows * numel * torch.empty((), dtype=record.dtype).element_size()


def under_the_backend(rank: int, world_size: int) -> dict:
    """gpt-moe-tiny under torch.compile's commfx backend with a bf16 plan: the all-to-alls'
    row dtypes, the output's and gradients' dtypes, and how far it is from the eager model."""
    from commfx.backend import backend

    model, (ids,) = load_model("gpt-moe-tiny")
    local = split_batch(ids, world_size, rank)
    eager = model(local).detach()
    be = backend(dataclasses.replace(Plan.from_cli("lift,expert_parallel", world_size=world_size), precision="bf16"), model)
    compiled = torch.compile(model, backend=be, fullgraph=True)
    compiled(local)  # compiles
    be._scheduler.records = []
    out = compiled(local)
    out.square().mean().backward()
    rows = [r for r in be._scheduler.records if r.kind == "all_to_all" and r.dtype.is_floating_point]
    return {
        "row_dtypes": sorted({str(r.dtype) for r in rows}),
        "out_dtype": str(out.dtype),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "diff_from_eager": (out.detach() - eager).abs().max().item() / eager.abs().max().item(),
    }
