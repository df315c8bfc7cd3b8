"""Functions the resize_tp tests run on every rank (imported by the worker processes)."""

import copy
import random

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.runtime.semi import SemiState

SPEC = "gpt-moe-tiny"


def _step(dm, ids, probe):
    """One forward and backward; the output and every local gradient (then zeroed)."""
    out = dm(ids)
    (out * probe).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in dm.module.named_parameters() if p.grad is not None}
    dm.zero_grad(set_to_none=True)
    return out.detach(), grads


def _diff(a, b) -> float:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    return max([(out_a - out_b).abs().max().item()] + [(grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a])


def _records(dm, ids, probe, skip=("tp_timings",)):
    dm.scheduler.records = []
    _step(dm, ids, probe)
    records = [(r.kind, r.group, r.send_rows, r.recv_rows, str(r.dtype)) for r in dm.scheduler.records if r.kind not in skip]
    dm.scheduler.records = None
    return records


def resize_suite(rank: int, world_size: int) -> dict:
    model, (ids,) = load_model(SPEC, dtype=torch.float64)
    probe = torch.randn((*ids.shape, model.lm_head.out_features), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    plain = distribute(copy.deepcopy(model), Plan.from_cli("lift,tensor_parallel", world_size=world_size, tp=world_size), (ids,))
    dm = distribute(model, Plan.from_cli("lift,tensor_parallel,resize_tp:window=2", world_size=world_size, tp=world_size), (ids,))
    controller = dm.straggler
    resizer = controller.resizer
    # While the function is checked, every rank reports the same time per unit of work: no decision.
    controller.adjust = lambda step, seconds: 0.1 * controller.my_work()
    reference = _step(plain, ids, probe)
    result = {"linears": len(resizer.linears), "plain_untouched": _diff(reference, _step(dm, ids, probe))}

    # S = every column, through the resizing code path: plain tensor parallelism.
    resizer.resize(1.0, kept={key: list(range(resizer.plan(key).width)) for key in resizer.linears})
    result["all_kept"] = _diff(reference, _step(dm, ids, probe))
    resizer.restore()

    # Migration: half of rank 1's row-parallel columns computed by rank 0, summed back.
    dm.scheduler.stats.reset()
    resizer.migrate(1, 0, 0.5)
    result["migrated"] = _diff(reference, _step(dm, ids, probe))
    result["migration_bytes"] = dm.scheduler.stats.as_dict().get("tp_migrate", {})
    resizer.restore()
    result["restored"] = _diff(reference, _step(dm, ids, probe))

    # A real resize on rank 1 only: the function changes, no collective's shape does.
    records_plain = _records(dm, ids, probe)
    resizer.resize(0.5 if resizer.tp_rank == 1 else 1.0)
    records_resized = _records(dm, ids, probe)
    result["records_plain"], result["records_resized"] = records_plain, records_resized
    result["records_reference"] = _records(plain, ids, probe)
    result["resized"] = _diff(reference, _step(dm, ids, probe))
    result["error"] = resizer.error()
    result["kept"] = {key: resizer.plan(key).kept for key in resizer.linears}
    state = copy.deepcopy(dm.state_dict())
    resizer.restore()
    dm.load_state_dict(state)
    result["kept_after_load"] = {key: resizer.plan(key).kept for key in resizer.linears}
    resizer.restore()

    # Training: AdamW with migration on, off again, equals AdamW without it.
    start = copy.deepcopy(dm.state_dict())
    runs = []
    for migrate in (False, True):
        dm.load_state_dict(start)
        optimizer = torch.optim.AdamW(dm.parameters(), lr=1e-2)
        for step in range(3):
            if migrate:
                resizer.migrate(1, 0, 0.5) if step < 2 else resizer.restore()
            out = dm(ids)
            (out * probe).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runs.append({n: p.detach().clone() for n, p in dm.module.named_parameters()})
    result["training_diff"] = max((runs[0][n] - runs[1][n]).abs().max().item() for n in runs[0])
    dm.load_state_dict(start)

    # The controller: rank 1 2.5x slower for 6 steps, then recovered; each rank's clock has
    # its own noise, yet every rank takes the same decisions (from the all-reduced times).
    noise = random.Random(1000 + rank)
    seen = []

    def synthetic(step, _seconds):
        slow = 2.5 if resizer.tp_rank == 1 and step < 6 else 1.0
        seen.append(0.1 * slow * controller.my_work() * (1 + noise.uniform(-0.05, 0.05)))
        return seen[-1]

    controller.adjust = synthetic
    controller.decisions.clear()
    controller.state = SemiState()
    for _ in range(8):
        _step(dm, ids, probe)
    result["decisions"] = [d.line() for d in controller.decisions]
    result["actions"] = [d.action for d in controller.decisions]
    result["seen"] = seen
    result["restored_at_end"] = resizer.migration is None and resizer.fraction == 1.0
    return result
