"""Functions the peer tests run on every rank (imported by the worker processes)."""

import contextlib
import hashlib

import torch
import torch.nn.functional as F

from commfx.models import load_model


@contextlib.contextmanager
def _wrong_experts(active: bool):
    """GELU for SiLU in every DeepSpeed expert of this rank: a peer that computes another function."""
    from commfx.bench.peers import deepspeed_moe

    original = deepspeed_moe.GatedExpert.forward

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.gelu(gate) * up, self.down_proj)

    if active:
        deepspeed_moe.GatedExpert.forward = forward
    try:
        yield
    finally:
        deepspeed_moe.GatedExpert.forward = original


def deepspeed_moe_check(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Each case: model spec, load_model kwargs, and check_deepspeed_moe's options (`break_rank`:
    that rank's experts compute GELU for SiLU). Returns each case's PeerCheck as a dict, or the
    PeerUnsupported message."""
    import dataclasses

    from commfx.bench.peers import PeerUnsupported
    from commfx.bench.peers.deepspeed_moe import check_deepspeed_moe

    results = []
    for case in cases:
        case = dict(case)
        model, inputs = load_model(case.pop("model"), **case.pop("model_kwargs", {}))
        broken = case.pop("break_rank", None) == rank
        try:
            with _wrong_experts(broken):
                check = check_deepspeed_moe(model, inputs, **case)
        except PeerUnsupported as error:
            results.append({"unsupported": str(error)})
            continue
        results.append(dataclasses.asdict(check) | {"ok": check.ok, "line": check.line()})
    return results


@contextlib.contextmanager
def _count_torch_collectives(counter: list):
    import torch.distributed as dist

    names = ["all_reduce", "all_to_all_single", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier"]
    originals = {n: getattr(dist, n) for n in names}

    def counting(function):
        def call(*args, **kwargs):
            counter.append(function.__name__)
            return function(*args, **kwargs)
        return call

    for n, f in originals.items():
        setattr(dist, n, counting(f))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)


def deepspeed_moe_steps(rank: int, world_size: int, steps: int) -> dict:
    """Train the float32 gpt-moe peer for `steps` steps on this rank's half, then one compute-only step."""
    from commfx.bench.peers.deepspeed_moe import DeepSpeedMoEPeer
    from commfx.verify import local_batch

    model, inputs = load_model("gpt-moe")
    peer = DeepSpeedMoEPeer(model, local_batch(inputs, world_size, rank), ep_size=world_size, lr=1e-2)
    losses = [peer.train_step().item() for _ in range(steps - 1)]
    real: list = []
    with _count_torch_collectives(real):  # the counter sees DeepSpeed's collectives in a real step
        losses.append(peer.train_step().item())
    kinds = {}
    for record in peer.records:
        kinds[record.kind] = kinds.get(record.kind, 0) + 1
    digest = hashlib.sha256()
    for name, p in peer.module.named_parameters():
        if "deepspeed_experts" not in name:
            digest.update(p.detach().numpy().tobytes())
    ran: list = []
    with _count_torch_collectives(ran):
        peer.compute_only()
    compute_kinds = {}
    for record in peer.records:
        compute_kinds[record.kind] = compute_kinds.get(record.kind, 0) + 1
    return {"losses": losses, "kinds": kinds, "bytes": peer.step_bytes(), "params_digest": digest.hexdigest(),
            "compute_only_kinds": compute_kinds, "compute_only_ran_collectives": len(ran), "step_ran_collectives": len(real)}


def time_deepspeed_moe_vs_commfx(rank: int, world_size: int, steps: int, warmup: int, model_kwargs: dict,
                                 passes: str = "lift,expert_parallel") -> dict:
    """Not a test: a first same-run timing of the peer against commfx's plan on the same model,
    batch and optimizer (AdamW, lr 1e-3), interleaved step by step (order alternating), each step
    after a barrier. Returns this rank's per-step seconds (training step and compute-only step)."""
    import time

    import torch.distributed as dist

    from commfx.api import distribute
    from commfx.bench.peers.deepspeed_moe import DeepSpeedMoEPeer
    from commfx.plan import Plan
    from commfx.runtime.comm import install_default
    from commfx.train import loss_fn
    from commfx.verify import local_batch

    kwargs = dict(model_kwargs)
    model, inputs = load_model("gpt-moe", **kwargs)
    local = local_batch(inputs, world_size, rank)
    peer = DeepSpeedMoEPeer(model, local, ep_size=world_size, lr=1e-3)
    model, _ = load_model("gpt-moe", **kwargs)
    dm = distribute(model, Plan.from_cli(passes, world_size=world_size), local)
    optimizer = torch.optim.AdamW(dm.parameters(), lr=1e-3)

    def commfx_step():
        install_default(dm.scheduler)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(dm(*local), local).backward()
        optimizer.step()
        dm.synchronize()

    def commfx_compute_only():
        dm.scheduler.local_only = True
        try:
            commfx_step()
        finally:
            dm.scheduler.local_only = False

    runs = {"deepspeed_moe": peer.train_step, "commfx": commfx_step,
            "deepspeed_moe compute-only": peer.compute_only, "commfx compute-only": commfx_compute_only}
    times = {name: [] for name in runs}
    for index in range(warmup + steps):
        order = list(runs.items()) if index % 2 == 0 else list(runs.items())[::-1]
        for name, run in order:
            dist.barrier()
            start = time.perf_counter()
            run()
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    peer.train_step()
    dm.scheduler.stats.reset()
    commfx_step()
    return {"times": times, "peer_bytes": peer.step_bytes(), "commfx_bytes": dm.scheduler.stats.as_dict()}


def ddp_check(rank: int, world_size: int, model: str, perturb_rank: int | None = None) -> dict:
    """peer:ddp's check on `model`; with `perturb_rank`, that rank's copy of the model differs
    (DDP then trains rank 0's weights on every rank, which another rank's reference does not)."""
    from commfx.bench.peers.ddp import check

    module, inputs = load_model(model, batch=4)
    if rank == perturb_rank:
        with torch.no_grad():
            next(module.parameters()).add_(0.1)
    result = check(module, inputs, ep_size=1, lr=1e-2)
    return {"ok": result.ok, "line": result.line(), "grad_diffs": result.grad_diffs, "output_diff": result.output_diff}
