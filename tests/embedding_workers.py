"""What every rank runs in the split_embedding_comm distributed tests (imported by the workers)."""

import sys
import threading
import time
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


# ------------------------------------------- split_embedding_comm:schedule=2d (test_embrace_2d.py)

STREAM_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),  # not split by rows: each table stepped whole
}


def _halving(optimizer):
    """An LR scheduler that changes the learning rate after every step (a missed step must use the old one)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def stream_batch(rows: int, step: int) -> torch.Tensor:
    """Step `step`'s global batch of a stream: a different draw each step (rows 40..63 of tok never read)."""
    from embedding_lm import batch

    return batch(rows, seed=step)


def _stream_loss(out, rows, step, world_size, rank):
    return (out * split_batch(probes([out], rows, step)[0], world_size, rank)).sum()


class _HeldWork:
    """A collective issued only once `gate` opens (at most `timeout_s` later), on a thread of
    its own: the dispatcher sees a work whose future completes when the collective has."""

    def __init__(self, issue, gate: threading.Event, timeout_s: float):
        self.future = torch.futures.Future()
        threading.Thread(target=self._run, args=(issue, gate, timeout_s), daemon=True).start()

    def _run(self, issue, gate, timeout_s):
        gate.wait(timeout_s)
        try:
            work = issue()
            if work is not None:
                work.wait()
            self.future.set_result(None)
        except BaseException as error:  # noqa: BLE001 - handed to the dispatcher
            self.future.set_exception(error)

    def get_future(self):
        return self.future


class HoldLater:
    """Holds every rows_later exchange a step posts on the wire until `release()` (called
    after the next step's forward), on every rank alike: a lookup that waited for them
    would stall for `timeout_s`, then see them arrive before it stepped any row."""

    def __init__(self, dispatcher, timeout_s: float = 20.0):
        self.gate, self.timeout_s = threading.Event(), timeout_s
        submit = dispatcher.submit

        def held(pending):
            if pending.priority == "rows_later" and pending.issue is not None:
                issue, gate = pending.issue, self.gate
                pending.issue = lambda: _HeldWork(issue, gate, self.timeout_s)
            return submit(pending)

        dispatcher.submit = held

    def release(self) -> None:
        self.gate.set()
        self.gate = threading.Event()


def _optimizer_state(dm, optimizer) -> dict:
    names = {id(p): n for n, p in dm.module.named_parameters()}
    return {names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for p, state in optimizer.state.items()}


def train_stream(rank: int, world_size: int, rows: int, plans: list[str], optimizers: list[str], steps: int,
                 next_batch: bool = True, save_at: int = 0, checkpoint_dir: str = "", hold_later: bool = False) -> dict:
    """Per plan and optimizer: the losses, parameters and optimizer state after `steps` steps
    on a stream of batches (an LR scheduler halving the rate each step), the 2d schedule
    told each next batch, and the row schedule's events (what, table, seconds from the
    first, rows) and an eval call's output after the last step; with `save_at`, a commfx.save after that step, training on, and a fresh
    module resumed from the checkpoint trained to the end too ("resumed"). `hold_later`:
    each step's rows_later exchanges stay on the wire until the next step's forward is done
    (`HoldLater`); the finish times of those exchanges per step are kept ("later_done")."""
    from embedding_lm import build

    import commfx

    results = {}
    for passes in plans:
        def fresh():
            model, _ = build(rows)
            return distribute(model.double(), Plan.from_cli(passes, world_size=world_size), (split_batch(stream_batch(rows, 0), world_size, rank),))

        def with_optimizer(dm, name):
            optimizer = STREAM_OPTIMIZERS[name](dm.parameters())
            dm.attach_optimizer(optimizer)
            return optimizer, _halving(optimizer)

        def run(dm, optimizer, scheduler, first, last, losses, hold=None):
            for step in range(first, last):
                local = split_batch(stream_batch(rows, step), world_size, rank)
                optimizer.zero_grad(set_to_none=True)
                out = dm(local)
                if hold is not None:
                    hold.release()  # the step before's rows_later may arrive now
                loss = _stream_loss(out, rows, step, world_size, rank)
                if next_batch:
                    dm.next_batch(split_batch(stream_batch(rows, step + 1), world_size, rank))
                loss.backward()
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                if save_at and step + 1 == save_at:
                    commfx.save(dm, optimizer, checkpoint_dir, step=save_at)

        dm = fresh()
        start = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dm.state_dict().items()}
        for name in optimizers:  # one module per plan (lowered once), restarted from the same state per optimizer
            dm.load_state_dict(start)
            optimizer, scheduler = with_optimizer(dm, name)
            caught_up = dm.rows.caught_up
            losses: list[float] = []
            dm.scheduler.dispatcher.history = []
            dm.rows.events = []
            hold = HoldLater(dm.scheduler.dispatcher) if hold_later and "schedule=2d" in passes else None
            start_s = time.perf_counter()
            run(dm, optimizer, scheduler, 0, steps, losses, hold)
            pending = dm.rows.pending
            if hold is not None:
                hold.release()
            with torch.no_grad():  # an eval call settles every table first
                evaluated = dm(split_batch(stream_batch(rows, steps), world_size, rank))
            settled_by_eval = not dm.rows.pending
            dm.synchronize()
            row_bytes: dict[str, int] = {}
            later_done: dict[str, list[float]] = {}
            for done in dm.scheduler.dispatcher.history:
                if done.priority.startswith("rows_"):
                    row_bytes[done.priority] = row_bytes.get(done.priority, 0) + done.nbytes
                if done.priority == "rows_later" and "row grads" in done.tag:
                    later_done.setdefault(done.tag.split(" row grads")[0], []).append(done.t_done - start_s)
            dm.scheduler.dispatcher.history = None
            events = [(what, table, t - start_s, count) for what, table, t, count in dm.rows.events]
            dm.rows.events = None
            result = {"losses": losses, "pending_before_sync": pending, "caught_up": dm.rows.caught_up - caught_up, "row_bytes": row_bytes,
                      "params": {n: p.detach().clone() for n, p in dm.module.named_parameters()}, "placement": dm.placement,
                      "optimizer_state": _optimizer_state(dm, optimizer), "events": events, "later_done": later_done,
                      "eval": evaluated, "settled_by_eval": settled_by_eval,
                      "local_rows": {n: p.shape[0] for n, p in dm.module.named_parameters()}}
            if save_at:
                resumed_dm = fresh()
                optimizer2, scheduler2 = with_optimizer(resumed_dm, name)
                commfx.load(resumed_dm, optimizer2, checkpoint_dir)
                scheduler2.load_state_dict(scheduler.state_dict() | {"last_epoch": save_at, "_step_count": save_at + 1})
                resumed: list[float] = []
                run(resumed_dm, optimizer2, scheduler2, save_at, steps, resumed)
                resumed_dm.synchronize()
                result["resumed"] = {"losses": resumed, "params": {n: p.detach().clone() for n, p in resumed_dm.module.named_parameters()}}
            results[(passes, name)] = result
    return results


def stream_reference(world_size: int, rows: int, optimizers: list[str], steps: int) -> dict:
    """Dense data parallelism in one process on the same stream: the ranks' losses summed, over world (DDP's mean)."""
    from embedding_lm import build

    out = {}
    for name in optimizers:
        model, _ = build(rows)
        model = model.double()
        optimizer = STREAM_OPTIMIZERS[name](model.parameters())
        scheduler = _halving(optimizer)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            logits = model(stream_batch(rows, step))
            ((logits * probes([logits], rows, step)[0]).sum() / world_size).backward()
            optimizer.step()
            scheduler.step()
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
