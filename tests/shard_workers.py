"""What every rank runs in the shard_states tests."""

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.runtime.memory import held_bytes
from commfx.runtime.sharded_optimizer import shard_optimizer
from commfx.train import loss_fn
from commfx.verify import split_batch

STEPS = 3


def train_each_plan(rank: int, world_size: int, plans: list[str], rows: int = 7, bucket_bytes: int = 0, with_misuse: bool = False) -> dict:
    """Per plan ("passes", "passes|ep=N" or "passes|tp=N"): the losses of STEPS AdamW steps (weight decay,
    an LR scheduler halving the rate each step), the parameters after them, the held bytes
    after the last step, how many elements this rank's optimizer steps, and the parameters
    after one more step of a fresh optimizer that loaded the first one's state_dict."""
    from commfx.verify import data_share, local_batch

    _, (ids,) = load_model("gpt-moe-tiny", dtype=torch.float64, batch=rows, seq=8)
    results = {}
    for passes in plans:
        model, _ = load_model("gpt-moe-tiny", dtype=torch.float64, batch=rows, seq=8)
        spec, _, ep = passes.partition("|ep=")  # "passes|ep=1": experts replicated over edp
        spec, _, tp = spec.partition("|tp=")  # "passes|tp=2": tensor parallel inside each dp replica
        plan = Plan.from_cli(spec, world_size=world_size, ep=int(ep or 0), tp=int(tp or 1))
        local = local_batch((ids,), *data_share(plan, rank))  # a tensor-parallel group reads the same rows
        if bucket_bytes:
            import dataclasses

            plan = dataclasses.replace(plan, grad_bucket_bytes=bucket_bytes)
        dm = distribute(model, plan, local)
        optimizer = shard_optimizer(dm, torch.optim.AdamW, lr=0.02, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        dm.attach_optimizer(optimizer)
        losses, whole = [], []
        gather = getattr(dm.grad_sync, "params", None)  # stage 3's gathered buckets
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(dm(*local), local)
            whole.append(sum(gather.whole) if gather else None)
            loss.backward()
            whole.append(sum(gather.whole) if gather else None)
            losses.append(loss.detach())
            optimizer.step()
            schedule.step()

        dm.settle()  # a step boundary: stage 3's parameters stay sharded
        whole.append(sum(gather.whole) if gather else None)

        def one_more_step(resumed):
            resumed.zero_grad(set_to_none=True)
            loss_fn(dm(*local), local).backward()
            resumed.step()

        trained = after_training(dm, optimizer, one_more_step)  # ends in synchronize(): every parameter whole
        whole.append(sum(gather.whole) if gather else None)
        results[passes] = {
            "losses": torch.stack(losses),
            **trained,
            "stepped": sum(v.numel() for g in getattr(optimizer, "optimizer", optimizer).param_groups for v in g["params"]),
            "whole_after_forward_and_backward": whole,
            "buckets": len(gather.shards) if gather else 0,
        }
    if with_misuse:
        results["misuse"] = misuse(rank, world_size)
    return results


def after_training(dm, optimizer, one_more_step) -> dict:
    """The bytes held, the parameters, and the parameters after `one_more_step(resumed)` of a
    fresh sharded optimizer that loaded `optimizer`'s state_dict."""
    memory = held_bytes(dm, optimizer)
    saved = optimizer.state_dict()
    dm.synchronize()  # stage 3: every parameter whole until the next step
    params = {n: p.detach().clone() for n, p in dm.module.named_parameters()}
    resumed = shard_optimizer(dm, torch.optim.AdamW, lr=0.02, weight_decay=0.1)
    resumed.load_state_dict(saved)
    one_more_step(resumed)
    dm.synchronize()
    return {"params": params, "resumed": {n: p.detach().clone() for n, p in dm.module.named_parameters()}, "memory": memory}


def misuse(rank: int, world_size: int) -> dict:
    """What a stage-2 module says to a plain optimizer, and to a backward without its optimizer."""
    _, (ids,) = load_model("gpt-moe-tiny", dtype=torch.float64, batch=4, seq=8)
    local = (split_batch(ids, world_size, rank),)
    model, _ = load_model("gpt-moe-tiny", dtype=torch.float64, batch=4, seq=8)
    dm = distribute(model, Plan.from_cli("lift,expert_parallel,shard_states:stage=2", world_size=world_size), local)
    said = {}
    try:
        dm.attach_optimizer(torch.optim.AdamW(dm.parameters()))
    except TypeError as error:
        said["attach"] = str(error)
    try:
        loss_fn(dm(*local), local).backward()
    except RuntimeError as error:
        said["backward"] = str(error)
    return said


def train_pipeline_plans(rank: int, world_size: int, plans: list[str], bucket_bytes: int = 2048) -> dict:
    """pp=2 x dp=2, per plan: STEPS AdamW steps of gpt-moe (float64, an LR scheduler),
    each step's loss on the last stage, this stage's parameters after them and after one more
    step of a fresh optimizer that loaded the first one's state_dict, and the bytes held."""
    import copy
    import dataclasses

    from commfx.verify import local_batch, data_share
    from pipeline_workers import lm_loss

    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=8, seq=8)
    results = {}
    for passes in plans:
        plan = dataclasses.replace(Plan.from_cli(passes, world_size=world_size, pp=2), grad_bucket_bytes=bucket_bytes)
        local = local_batch((ids,), *data_share(plan, rank))
        dm = distribute(copy.deepcopy(model), plan, local)
        optimizer = shard_optimizer(dm, torch.optim.AdamW, lr=0.02, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

        def step(opt):
            opt.zero_grad(set_to_none=True)
            result = dm.step(*local, loss_fn=lambda outputs, mb: lm_loss(outputs, mb.inputs[0]))
            opt.step()
            return result.loss

        losses = []
        for _ in range(STEPS):
            losses.append(step(optimizer))
            schedule.step()
        results[passes] = {
            "losses": [None if loss is None else float(loss) for loss in losses],
            **after_training(dm, optimizer, step),
            "stage": dm.stage_index,
        }
    return results
