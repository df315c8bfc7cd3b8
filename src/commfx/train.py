"""A short training run on a local world: what `commfx run` and the demo execute per rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from .models import load_model
from .ops.locality import LAST_AUX_LOSSES, LAST_CAPACITY, aux_loss_report, capacity_report
from .plan import Plan
from .runtime.machine_probe import NOTE as MACHINE_NOTE
from .runtime.memory import held_bytes
from .runtime.sharded_optimizer import shard_optimizer
from .runtime.trace import Timeline, rank_trace_path


@dataclass
class TrainConfig:
    model: str
    plan: Plan
    steps: int = 5
    lr: float = 1e-2
    seed: int = 0
    batch: int | None = None
    dump_path: str | None = None
    trace_path: str | None = None  # each rank writes its timeline next to it (see runtime/trace.py)
    dtype: str = "float32"
    checkpoint_dir: str | None = None  # save every `checkpoint_every` steps here (commfx.save)
    checkpoint_every: int = 0
    resume: str | None = None  # a checkpoint (or a --checkpoint-dir) to start from (commfx.load)
    export_dir: str | None = None  # after the last step, the whole model for transformers (commfx.export_hf)
    device: str = "cpu"  # "cuda": this rank's GPU, NCCL between ranks (runtime/devices.py)


def loss_fn(outputs, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The model's own loss when it returns one (a 0-dim tensor); next-token cross entropy for a
    language model (int inputs, [B, S, V] logits); else mean square."""
    logits = pytree.tree_flatten(outputs)[0][0]
    if logits.dim() == 0 and logits.is_floating_point():
        return logits
    ids = inputs[0]
    if ids.dim() and ids.shape[0] == 0:  # a rank without rows this step: no loss, but it still runs backward
        return logits.float().sum() * 0
    if not ids.is_floating_point() and logits.dim() == 3 and ids.dim() == 2:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return logits.float().pow(2).mean()


def step_not_finite(dm, loss: torch.Tensor | None) -> tuple[int, str, str] | None:
    """(0, 'the loss', 'nan') or (1, 'the gradient of NAME', 'inf'): this rank's loss or first
    gradient that is NaN or inf this step. Gradients still on the wire (defer_grad_sync) cannot
    be read here; a NaN in them shows in the next step's loss."""
    from .verify import not_finite

    found = not_finite([("the loss", loss)])
    if found:
        return 0, *found
    if getattr(dm, "deferred", None) is not None:
        return None
    found = not_finite((f"the gradient of {n}", p.grad) for n, p in dm.module.named_parameters())
    return (1, *found) if found else None


def stop_if_not_finite(problems: list, step: int, rank: int) -> bool:
    """Every rank has gathered every rank's problem: the rank with the first one (a loss before
    a gradient, which an all-reduce spreads to every rank) raises, the others stop (True)."""
    from .verify import NonFiniteError

    found = sorted((p[0], r, p[1], p[2]) for r, p in enumerate(problems) if p)
    if not found:
        return False
    _, first, what, kind = found[0]
    if rank == first:
        raise NonFiniteError(
            f"step {step}: {what} on rank {first} is not finite ({kind}); training stopped. Lower --lr, or check the model and its "
            "inputs (commfx verify compares the distributed run with the single-process model)"
        )
    return True


def resume(dm, optimizer, path: str, rank: int) -> int:
    """Load the checkpoint at `path` (commfx.load) and return the step it was saved after."""
    from .checkpoint import load

    info = load(dm, optimizer, path)
    if rank == 0:
        print(f"resumed from {info['path']} after step {info['step']}" + "".join(f"; {n}" for n in info["notes"]), flush=True)
    return info["step"]


def checkpoint(dm, optimizer, root: str, step: int, rank: int) -> None:
    from .checkpoint import save

    start = time.perf_counter()
    path = save(dm, optimizer, root, step=step)
    if rank == 0:
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"checkpoint {path} ({size:,} bytes, {time.perf_counter() - start:.2f}s)", flush=True)


def train_worker(rank: int, world_size: int, config: TrainConfig) -> dict:
    from .api import distribute
    from .compiler.render import render
    from .runtime.pipeline.module import PipelineModule
    from .verify import batch_tensors, call, data_share, local_batch, pipeline_step

    kwargs = {"batch": config.batch} if config.batch else {}
    model, inputs = load_model(config.model, seed=config.seed, dtype=getattr(torch, config.dtype), **kwargs)
    device = torch.device(config.device, torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    model = model.to(device)  # built on the CPU with the seed's weights: every device trains the same model
    local = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), local_batch(inputs, *data_share(config.plan, rank)))
    tensors = batch_tensors(local)
    dm = distribute(model, config.plan, local)
    pipelined = isinstance(dm, PipelineModule)
    if rank == 0:  # Plan(machine="measure"): what the cost models were given
        for note in (n for n in dm.program.notes if n.startswith(MACHINE_NOTE)):
            print(note, flush=True)
    if rank == 0 and config.dump_path:
        with open(config.dump_path, "w") as f:
            f.write(render(dm.module))
    optimizer = shard_optimizer(dm, torch.optim.AdamW, lr=config.lr)  # sharded under shard_states, else plain AdamW
    if not pipelined:  # pack_experts:replace_every re-places experts between steps
        dm.attach_optimizer(optimizer)
    first_step = resume(dm, optimizer, config.resume, rank) if config.resume else 0
    if config.trace_path:
        dm.timeline = Timeline(rank)
        dm.scheduler.dispatcher.history = []
    history, memory = [], held_bytes(dm, optimizer)
    for step in range(first_step, config.steps):
        start = time.perf_counter()
        LAST_CAPACITY.clear()
        LAST_AUX_LOSSES.clear()
        dm.scheduler.stats.reset()
        optimizer.zero_grad(set_to_none=True)
        if pipelined:  # forward and backward over micro-batches; the last stage has the loss
            loss = pipeline_step(dm, local, loss_fn=lambda outputs, mb: loss_fn(outputs, mb.inputs)).loss
        else:
            loss = loss_fn(call(dm, local), tensors)
            if step + 1 < config.steps:  # one fixed batch: the next step reads the same rows (split_embedding_comm:schedule=2d)
                call(dm.next_batch, local)
            loss.backward()
        problem = step_not_finite(dm, loss)
        optimizer.step()
        elapsed = time.perf_counter() - start
        memory = held_bytes(dm, optimizer)  # after the step, gradients still held: the step's peak of held state
        if dm.timeline is not None:
            dm.timeline.step(step + 1, start, start + elapsed)
        stats = dm.scheduler.stats
        gathered = dm.scheduler.all_gather_object(
            (None if loss is None else loss.item(), stats.total_bytes(), sum(stats.inter_node_bytes.values()), elapsed, tensors[0].shape[0], problem)
        )
        if stop_if_not_finite([g[5] for g in gathered], step + 1, rank):
            break
        # ranks without rows this step, and pipeline stages before the last, report no loss
        with_rows = [g[0] for g in gathered if g[4] > 0 and g[0] is not None]
        mean_loss = sum(with_rows) / len(with_rows)
        record = {
            "step": step + 1,
            "loss": mean_loss,
            "bytes": sum(g[1] for g in gathered),
            "inter_node_bytes": sum(g[2] for g in gathered),
            "seconds": max(g[3] for g in gathered),
            "by_kind": stats.as_dict(),
        }
        if LAST_CAPACITY:  # locality_gate in capacity mode: LocMoE's floor measured on this rank's batch
            record["capacity"] = {tag: dict(c) for tag, c in LAST_CAPACITY.items()}
        if LAST_AUX_LOSSES:  # locality_gate's balance and locality losses (in the gradient, not in `loss`)
            record["aux_losses"] = {tag: list(v) for tag, v in LAST_AUX_LOSSES.items()}
        history.append(record)
        if rank == 0:
            print(
                f"step {record['step']:>3}/{config.steps}  loss {mean_loss:.4f}  "
                f"bytes {record['bytes']:>10,}  ({record['inter_node_bytes']:,} inter-node)  {elapsed * 1000:.0f} ms",
                flush=True,
            )
            note = getattr(dm, "compile_note", lambda: None)() if step == first_step else None
            if note:  # Plan.compute="inductor": what the first step spent compiling
                print(note, flush=True)
            if LAST_AUX_LOSSES:
                print(aux_loss_report() + "  (rank 0's batch)", flush=True)
            if LAST_CAPACITY:
                print(capacity_report() + "  (rank 0's batch)", flush=True)
        if config.checkpoint_dir and config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            checkpoint(dm, optimizer, config.checkpoint_dir, step + 1, rank)
    if not pipelined:
        dm.synchronize()  # what is still on the wire (defer_grad_sync, schedule=2d) and the steps it owes
    if config.export_dir:
        from .checkpoint.hf import export_hf

        export_hf(dm, config.export_dir)
    local_params = sum(p.numel() for p in dm.parameters())
    trace = None
    if dm.timeline is not None:
        trace = str(dm.timeline.write(rank_trace_path(config.trace_path, rank), dm.scheduler.dispatcher.history))
    placements = getattr(dm, "placements", None)  # pack_experts: where each expert sits, and how often it moved
    expert_placement = {
        op: {"slot_of": s["slot_of"], "replacements": s["replacements"]} for op, s in (placements.state() if placements else {}).items()
    }
    return {"history": history, "local_params": local_params, "memory": memory, "placement": dm.placement, "expert_placement": expert_placement, "trace": trace}
