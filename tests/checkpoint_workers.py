"""Functions the checkpoint tests run on every rank (imported by the worker processes)."""

from __future__ import annotations

import time

import torch

import commfx
from commfx.api import distribute
from commfx.batches import pipeline_step
from commfx.checkpoint.gather import gather_full
from commfx.checkpoint.state import packed_layers
from commfx.models import load_model
from commfx.plan import Plan
from commfx.runtime.pipeline.module import PipelineModule
from commfx.runtime.sharded_optimizer import shard_optimizer
from commfx.train import loss_fn
from commfx.verify import data_share, local_batch


def _module(model: str, passes: str, rank: int, world_size: int, ep: int = 0, seed: int = 5, tp: int = 1, pp: int = 1):
    batch = {} if ".py:" in model else {"batch": 4}  # a model file brings its own batch
    net = load_model(model, seed=seed, dtype=torch.float64, **batch)[0]
    inputs = load_model(model, seed=5, dtype=torch.float64, **batch)[1]  # the same batch whatever the weights
    plan = Plan.from_cli(passes, world_size=world_size, ep=ep, tp=tp, pp=pp)
    local = local_batch(inputs, *data_share(plan, rank))
    dm = distribute(net, plan, local)
    optimizer = shard_optimizer(dm, torch.optim.AdamW, lr=3e-3)
    if not isinstance(dm, PipelineModule):
        dm.attach_optimizer(optimizer)
    return dm, optimizer, local


def _train(dm, optimizer, local, steps: int) -> list[float]:
    """The mean loss of each step over the ranks that have one (a pipeline's last stage)."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if isinstance(dm, PipelineModule):
            loss = pipeline_step(dm, local, loss_fn=lambda outputs, mb: loss_fn(outputs, mb.inputs)).loss
        else:
            loss = loss_fn(dm(*local), local)
            loss.backward()
        optimizer.step()
        values = [v for v in dm.scheduler.all_gather_object(None if loss is None else loss.item()) if v is not None]
        losses.append(sum(values) / len(values))
    return losses


def _placements(dm) -> dict:
    return {op: layer.slot_of.tolist() for op, layer in packed_layers(dm).items()}


def save_and_resume(rank: int, world_size: int, root: str, model: str, passes: str, steps: int, save_at: int) -> dict:
    """Train `save_at` steps, save, train on; then a freshly distributed module loads the
    checkpoint and trains the same remaining steps. Both runs' losses, placements and full
    state (parameters and optimizer moments, gathered) are returned."""
    dm, optimizer, local = _module(model, passes, rank, world_size)
    losses = _train(dm, optimizer, local, save_at)
    path = commfx.save(dm, optimizer, root, step=save_at)
    at_save = gather_full(dm, optimizer)
    losses += _train(dm, optimizer, local, steps - save_at)
    first = {"at_save": at_save, "losses": losses, "placements": _placements(dm), "state": gather_full(dm, optimizer), "path": str(path)}
    dm2, optimizer2, local2 = _module(model, passes, rank, world_size, seed=99)  # other initial weights: all must come from the file
    info = commfx.load(dm2, optimizer2, root)
    loaded = gather_full(dm2, optimizer2)
    resumed = _train(dm2, optimizer2, local2, steps - save_at)
    second = {"losses": resumed, "placements": _placements(dm2), "state": gather_full(dm2, optimizer2), "step": info["step"], "loaded": loaded}
    return {"first": first, "second": second, "moved": [[d.moved for d in ds] for ds in dm.placement_log]}


def train_and_save(rank: int, world_size: int, root: str, model: str, passes: str, steps: int, save_at: int, **layout) -> dict:
    """Train, saving after `save_at` steps; losses of every step and the final full state.
    `layout`: ep, tp, pp."""
    dm, optimizer, local = _module(model, passes, rank, world_size, **layout)
    losses = _train(dm, optimizer, local, save_at)
    commfx.save(dm, optimizer, root, step=save_at)
    at_save = gather_full(dm, optimizer)
    losses += _train(dm, optimizer, local, steps - save_at)
    return {"losses": losses, "at_save": at_save, "state": gather_full(dm, optimizer), "placements": _placements(dm)}


def load_and_train(rank: int, world_size: int, root: str, model: str, passes: str, steps: int, save_as: str = "", **layout) -> dict:
    """Load the checkpoint at this layout and train `steps` more (then save to `save_as`)."""
    dm, optimizer, local = _module(model, passes, rank, world_size, seed=99, **layout)
    info = commfx.load(dm, optimizer, root)
    loaded = gather_full(dm, optimizer)
    losses = _train(dm, optimizer, local, steps)
    if save_as:
        commfx.save(dm, optimizer, save_as, step=info["step"] + steps)
    return {"losses": losses, "loaded": loaded, "state": gather_full(dm, optimizer), "notes": info["notes"], "placements": _placements(dm)}


def load_refused(rank: int, world_size: int, root: str, model: str, passes: str, **layout) -> str:
    """The error `commfx.load` raises for this checkpoint here ('' if it loads)."""
    dm, optimizer, _ = _module(model, passes, rank, world_size, **layout)
    try:
        commfx.load(dm, optimizer, root)
    except commfx.CheckpointError as error:
        return str(error)
    return ""


def export_hf_model(rank: int, world_size: int, directory: str, model: str, passes: str, steps: int) -> dict:
    """Train an HF model a few steps and export it; the full state is returned to compare."""
    dm, optimizer, local = _module(model, passes, rank, world_size)
    _train(dm, optimizer, local, steps)
    commfx.export_hf(dm, directory)
    with torch.no_grad():
        logits = dm(*local)
    return {"state": gather_full(dm), "batch": local, "logits": logits}


def save_fails_on_rank0(rank: int, world_size: int, root: str, model: str, passes: str) -> dict:
    """Every rank saves to `root`, which rank 0 cannot create (its parent is a file) and the
    others never touch: what each rank raises, and how long it took to raise it."""
    dm, optimizer, local = _module(model, passes, rank, world_size)
    _train(dm, optimizer, local, 1)
    start = time.perf_counter()
    try:
        commfx.save(dm, optimizer, root, step=1)
    except commfx.CheckpointError as error:
        return {"error": str(error), "seconds": time.perf_counter() - start}
    return {"error": "", "seconds": time.perf_counter() - start}
