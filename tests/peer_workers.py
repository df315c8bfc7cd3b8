"""Functions the peer tests run on every rank (imported by the worker processes)."""

import contextlib
import hashlib

import torch
import torch.nn.functional as F

from commfx.models import load_model
from resize_workers import DenseTiny


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


# ------------------------------------------------------------------------------ peer:dtensor_tp


class _TPAttention(torch.nn.Module):
    """Separate q/k/v/o; heads shaped by the `num_heads` attribute (PyTorch's TP example style,
    `full_width=False`) or from the replicated input's width (`d // num_heads`, `full_width=True`)."""

    def __init__(self, hidden, heads, full_width):
        super().__init__()
        self.num_heads, self.head_dim, self.full_width = heads, hidden // heads, full_width
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(hidden, hidden, bias=name != "k") for name in "qkv")
        self.o_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, h):
        b, s, d = h.shape
        head_dim = d // self.num_heads if self.full_width else self.head_dim
        q, k, v = (f(h).view(b, s, self.num_heads, head_dim).transpose(1, 2) for f in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o_proj(y.reshape(b, s, d if self.full_width else self.num_heads * self.head_dim))


class _TPLayer(torch.nn.Module):
    def __init__(self, hidden, heads, mlp, full_width):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn = _TPAttention(hidden, heads, full_width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, mlp), torch.nn.GELU(), torch.nn.Linear(mlp, hidden))

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class DenseHeads(DenseTiny):
    """A dense GPT whose attention keeps its head count in an attribute (float64 tests):
    resize_workers' DenseTiny with other layers."""

    def __init__(self, vocab=32, hidden=32, heads=4, mlp=48, full_width=False):
        torch.nn.Module.__init__(self)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList([_TPLayer(hidden, heads, mlp, full_width) for _ in range(2)])
        self.head = torch.nn.Linear(hidden, vocab, bias=False)


def _tp_model(spec: str):
    if spec in ("dense-heads", "dense-full-width"):
        torch.manual_seed(0)
        model = DenseHeads(full_width=spec == "dense-full-width")
        return model, (torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1)),)
    return load_model(spec, batch=4)


def dtensor_tp_checks(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """dtensor_tp_check for each case (its keyword arguments), in one launch."""
    return [dtensor_tp_check(rank, world_size, **case) for case in cases]


def dtensor_tp_check(rank: int, world_size: int, model: str, restyle: dict | None = None, perturb: str | None = None,
                     perturb_rank: int = 1) -> dict:
    """peer:dtensor_tp's check on `model` (float64): `restyle` changes the inferred plan (path ->
    style; None removes the linear from it), `perturb` adds 0.1 to that parameter on
    `perturb_rank` only (DTensor scatters the split weights from rank 0, so that rank's reference
    differs from the model the peer runs). Returns the PeerCheck, or the PeerUnsupported message."""
    import dataclasses

    from commfx.bench.peers import PeerUnsupported
    from commfx.bench.peers.dtensor_tp import check, infer_plan

    module, inputs = _tp_model(model)
    if perturb is not None and rank == perturb_rank:
        with torch.no_grad():
            module.get_parameter(perturb).add_(0.1)
    try:
        styles = None
        if restyle:
            styles = infer_plan(module, inputs, world_size)[0]
            for path, style in restyle.items():
                styles.pop(path) if style is None else styles.__setitem__(path, style)
        result = check(module, inputs, ep_size=1, lr=1e-2, styles=styles)
    except PeerUnsupported as error:
        return {"unsupported": str(error)}
    return dataclasses.asdict(result) | {"ok": result.ok, "line": result.line()}


def dtensor_tp_steps(rank: int, world_size: int, model: str, steps: int = 2) -> dict:
    """The float32 peer trained `steps` steps on the whole batch, then one compute-only step: its
    records, bytes, losses, and the collectives that reached the wire in each."""
    from commfx.bench.peers.dtensor_tp import DTensorTPPeer, _Collectives

    module, inputs = _tp_model(model)
    peer = DTensorTPPeer(module, inputs, ep_size=1, lr=1e-2)
    losses = [peer.train_step().item() for _ in range(steps)]
    records = [(r.kind, r.group_size, r.nbytes) for r in peer.records]
    with _Collectives() as outer:  # below compute-only's own mode: sees what still communicates
        peer.compute_only()
    digest = hashlib.sha256()
    for p in peer.module.parameters():
        digest.update((p.to_local() if hasattr(p, "to_local") else p).detach().numpy().tobytes())
    return {"losses": losses, "records": records, "bytes": peer.step_bytes(), "records_after_compute_only": len(peer.records),
            "compute_only_collectives": len(outer.records), "params_digest": digest.hexdigest(), "notes": peer.notes}


def dtensor_tp_split_batch(rank: int, world_size: int) -> str:
    """The peer handed each rank its own half of the batch (a bench run without --tp WORLD)."""
    from commfx.bench.peers import PeerUnsupported
    from commfx.bench.peers.dtensor_tp import DTensorTPPeer
    from commfx.verify import local_batch

    module, inputs = _tp_model("dense-heads")
    try:
        DTensorTPPeer(module, local_batch(inputs, world_size, rank), ep_size=1, lr=1e-2)
    except PeerUnsupported as error:
        return str(error)
    return "accepted"


def ddp_check_on_a_loss_model(rank: int, world_size: int) -> dict:
    """peer:ddp on a model that returns only its loss (no per-row output to compare)."""
    from commfx.bench.peers.ddp import check

    model, inputs = load_model("gpt-moe-tiny", batch=4)

    class ReturnsItsLoss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids).pow(2).mean()

    result = check(ReturnsItsLoss(model), inputs, ep_size=1, lr=1e-2)
    return {"ok": result.ok, "line": result.line(), "loss_diff": result.loss_diff}


# ------------------------------------------------------------------------------ peer:fsdp2, peer:pipelining


def _two_layers(model: str) -> dict:
    """A stage each on 2 ranks: the layer count's field of the model's config."""
    return {"num_hidden_layers": 2} if model.startswith("hf:") else {"num_layers": 2}


def sharded_or_staged_check(rank: int, world_size: int, peer: str, model: str, options: dict | None = None,
                            perturb_rank: int = 1) -> list[dict]:
    """peer `peer`'s check on `model` (4 rows), twice: as given, then with `perturb_rank`'s copy
    of the model differing from the others' (its reference then is not the function the peer
    computes)."""
    from commfx.bench.peers import peer_module

    results = []
    for perturbed in (False, True):
        module, inputs = load_model(model, batch=4, **_two_layers(model))
        if perturbed and rank == perturb_rank:
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.05)
        result = peer_module(peer).check(module, inputs, ep_size=1, lr=1e-2, **(options or {}))
        results.append({"ok": result.ok, "line": result.line(), "grad_diffs": result.grad_diffs,
                        "output_diff": result.output_diff, "loss_diff": result.loss_diff})
    return results


def peer_steps(rank: int, world_size: int, peer: str, model: str, steps: int, options: dict | None = None) -> dict:
    """`steps` float64 training steps of the peer's Runner on its share of the batch, then a
    compute-only step with the torch collectives counted, and the records' replay."""
    from commfx.bench.peers import peer_module
    from commfx.bench.peers.common import replay
    from commfx.verify import local_batch

    module = peer_module(peer)
    model_, inputs = load_model(model, batch=8, **_two_layers(model))
    model_ = model_.double()
    share = inputs if getattr(module, "WHOLE_BATCH", False) else local_batch(inputs, world_size, rank)
    runner = module.Runner(model_, share, ep_size=1, lr=1e-2, **(options or {}))
    losses = [runner.train_step().item() for _ in range(steps)]
    kinds = sorted({r.kind for r in runner.records})
    ran: list = []
    with _count_torch_collectives(ran):
        runner.compute_only()
    replay(runner.records)
    return {"losses": losses, "kinds": kinds, "bytes": runner.step_bytes(), "compute_only_ran_collectives": len(ran)}


def reference_losses(model: str, steps: int) -> list[float]:
    """The single-process model's mean losses over `steps` AdamW steps on the whole batch (float64)."""
    from commfx.train import loss_fn

    model_, inputs = load_model(model, batch=8, **_two_layers(model))
    model_ = model_.double()
    optimizer = torch.optim.AdamW(model_.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model_(*inputs), inputs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
