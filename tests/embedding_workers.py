"""What every rank runs in the split_embedding_comm distributed tests (imported by the workers)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "model_files"))

from commfx.api import distribute  # noqa: E402
from commfx.plan import Plan  # noqa: E402
from commfx.verify import probes, split_batch  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
}
STEPS = 3


def train_each_strategy(rank: int, world_size: int, rows: int, strategies: list[str], backend: bool = False) -> dict:
    """Per strategy: step-0 outputs and gradients, bytes per step by kind, and the
    parameters after STEPS optimizer steps with each optimizer (restored in between)."""
    from embedding_lm import batch, build

    ids = batch(rows)
    local = split_batch(ids, world_size, rank)
    results = {}
    for strategy in strategies:
        model, _ = build(rows)
        model = model.double()
        plan = Plan.from_cli(f"lift,split_embedding_comm:strategy={strategy}", world_size=world_size)
        dm = distribute(model, plan, (local,))

        def probe_loss(step):
            out = dm(local)
            return out, (out * split_batch(probes([out], rows, step)[0], world_size, rank)).sum()

        result = _steps_with_each_optimizer(dm, probe_loss, "output")
        # commfx bench's compute-only step: every collective a local copy, so no id reaches its owner.
        dm.scheduler.local_only = True
        try:
            out = dm(local)
            out.sum().backward()
            result["compute_only_shape"] = tuple(out.shape)
        finally:
            dm.scheduler.local_only = False
        results[strategy] = result
    if backend:
        results["backend"] = _through_the_backend(rank, world_size, rows, local)
    return results


def _steps_with_each_optimizer(dm, forward, recorded: str) -> dict:
    """The split decisions and placement; step 0's `forward(step)` value (as `recorded`),
    gradients and bytes by kind; the parameters after STEPS steps of each optimizer, from
    the same start. `forward(step)` returns (the value to record, the loss to backpropagate)."""
    start = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dm.state_dict().items()}
    result = {"decisions": {k: v["strategy"] for k, v in dm.program.decisions["split_embedding_comm"].items()}, "placement": dm.placement}
    for name, make in OPTIMIZERS.items():
        dm.load_state_dict(start)
        optimizer = make(dm.parameters())
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            dm.scheduler.stats.reset()
            value, loss = forward(step)
            loss.backward()
            if step == 0 and name == "sgd":
                result[recorded] = value.detach()
                result["grads"] = {n: p.grad.clone() for n, p in dm.module.named_parameters()}
                result["bytes"] = dm.scheduler.stats.as_dict()
            optimizer.step()
        result[name] = {n: p.detach().clone() for n, p in dm.module.named_parameters()}
    return result


def _through_the_backend(rank: int, world_size: int, rows: int, local: torch.Tensor) -> dict:
    """torch.compile(model, backend=commfx.backend(plan)) with auto: row sharding is not
    available there (the user owns full-size tables), so auto picks sparse or dense."""
    from embedding_lm import build

    from commfx.backend import backend as commfx_backend

    model, _ = build(rows)
    model = model.double()
    be = commfx_backend(Plan.from_cli("lift,split_embedding_comm:strategy=sparse", world_size=world_size))
    out = torch.compile(model, backend=be, fullgraph=True)(local)
    (out * split_batch(probes([out], rows, 0)[0], world_size, rank)).sum().backward()
    return {
        "output": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "decisions": {k: v["strategy"] for k, v in be.programs[0].decisions["split_embedding_comm"].items()},
    }


def reference(world_size: int, rows: int) -> dict:
    """Dense data parallelism computed in one process: the same losses over the whole batch,
    times 1/world (the runtime averages gradients like DDP)."""
    from embedding_lm import batch, build

    ids = batch(rows)
    out = {}
    for name, make in OPTIMIZERS.items():
        model, _ = build(rows)
        model = model.double()
        optimizer = make(model.parameters())
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            logits = model(ids)
            ((logits * probes([logits], rows, step)[0]).sum() / world_size).backward()
            if step == 0 and name == "sgd":
                out["output"] = logits.detach()
                out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def train_each_head(rank: int, world_size: int, rows: int, heads: list[str]) -> dict:
    """A model that returns its own loss, per `head=` choice: the step-0 loss and gradients,
    bytes by kind, and the parameters after STEPS steps of each optimizer."""
    from embedding_lm import build_loss

    _, inputs = build_loss(rows)
    local = tuple(split_batch(t, world_size, rank) for t in inputs)
    results = {}
    for head in heads:
        model, _ = build_loss(rows)
        plan = Plan.from_cli(f"lift,split_embedding_comm:head={head}", world_size=world_size)
        dm = distribute(model.double(), plan, local)

        def own_loss(step):
            loss = dm(*local)
            return loss, loss

        results[head] = _steps_with_each_optimizer(dm, own_loss, "loss")
    return results


def loss_reference(world_size: int, rows: int) -> dict:
    """Dense data parallelism in one process: each rank's loss on its own share, the
    gradient of their mean (DDP's), and the same optimizer steps."""
    from embedding_lm import build_loss

    out = {}
    for name, make in OPTIMIZERS.items():
        model, inputs = build_loss(rows)
        model = model.double()
        optimizer = make(model.parameters())
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            losses = torch.stack([model(*(split_batch(t, world_size, r) for t in inputs)) for r in range(world_size)])
            losses.mean().backward()
            if step == 0 and name == "sgd":
                out["losses"] = losses.detach()
                out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
