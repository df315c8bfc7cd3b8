"""Functions the distributed tests run on every rank (imported by the worker processes)."""

import os

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.verify import split_batch


def die_mid_step(rank: int, world_size: int, dying_rank: int) -> str:
    model, (ids,) = load_model("gpt-moe-tiny")
    local = (split_batch(ids, world_size, rank),)
    dm = distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size), local)
    for step in range(3):
        if step == 1 and rank == dying_rank:
            os._exit(17)
        dm(*local).sum().backward()
    return "finished"


def wrong_world_size(rank: int, world_size: int) -> str:
    model, (ids,) = load_model("gpt-moe-tiny")
    distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size + 1), (ids,))
    return "no error"


def shard_and_checkpoint(rank: int, world_size: int) -> dict:
    model, (ids,) = load_model("gpt-moe", seed=3)
    full = sum(p.numel() for p in model.parameters())
    expert_full = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    local = (split_batch(ids, world_size, rank),)
    plan = Plan.from_cli("lift,expert_parallel", world_size=world_size)
    dm = distribute(model, plan, local)
    before = dm(*local).detach()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dm.state_dict().items()}
    with torch.no_grad():
        for p in dm.parameters():
            p.add_(1.0)
    changed = not torch.equal(dm(*local).detach(), before)
    dm.load_state_dict(state)
    restored = torch.equal(dm(*local).detach(), before)
    bad = dict(state)
    bad["_extra_state"] = {"placement": {k: [0, 1] for k in dm.placement}, "world_size": world_size}
    try:
        dm.load_state_dict(bad)
        mismatch_error = ""
    except ValueError as error:
        mismatch_error = str(error)
    return {
        "full": full,
        "expert_full": expert_full,
        "local": sum(p.numel() for p in dm.parameters()),
        "changed": changed,
        "restored": restored,
        "mismatch_error": mismatch_error,
    }


def compiled_with_backend(rank: int, world_size: int, batch: int) -> dict:
    from commfx.backend import backend
    from commfx.verify import probes

    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=batch)
    be = backend(Plan.from_cli("lift,expert_parallel", world_size=world_size))
    compiled = torch.compile(model, backend=be, fullgraph=True)
    local = split_batch(ids, world_size, rank)
    out = compiled(local)
    probe = split_batch(probes([out], ids.shape[0], 0)[0], world_size, rank)
    (out * probe).sum().backward()
    backward = be.graphs[0]["backward"]
    return {
        "output": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        # Lowered graphs hold split-phase all-to-alls (start, then wait) made by overlap_collectives.
        "backward_all_to_alls": sum(n.target is torch.ops.commfx.all_to_all_start.default for n in backward.graph.nodes),
    }


def _lina_training(rank: int, world_size: int, steps: int, delays: bool) -> dict:
    """Train with full Lina (k=4, tiny gradient chunks and buckets so there are many of both)."""
    import dataclasses
    import random
    import time

    from commfx.runtime.executor import GraphExecutor
    from commfx.train import loss_fn

    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=2 * world_size + 1)
    plan = Plan.from_cli("lift,expert_parallel,partition_a2a:k=4;grad_chunk_bytes=1024", world_size=world_size)
    plan = dataclasses.replace(plan, grad_bucket_bytes=16 * 1024, collective_timeout_s=60.0)
    local = split_batch(ids, world_size, rank)
    dm = distribute(model, plan, (local,))
    dm.scheduler.dispatcher.history = []
    optimizer = torch.optim.SGD(dm.parameters(), lr=0.05)
    rng = random.Random(7919 * (rank + 1))
    original = GraphExecutor.run_node

    def run_node_with_delays(self, node):
        if rng.random() < 0.04:  # random per-rank stalls inside forward and backward compute
            time.sleep(rng.uniform(0.0, 0.004))
        return original(self, node)

    losses = []
    GraphExecutor.run_node = run_node_with_delays if delays else original
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(dm(local), (local,))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        GraphExecutor.run_node = original
    history = dm.scheduler.dispatcher.history
    high = [p for p in history if p.priority == "a2a"]
    low = [p for p in history if p.priority == "grad"]
    # Lina's rule: no gradient chunk went on the wire while an all-to-all was queued or in flight.
    violations = sum(1 for g in low for a in high if a.t_submit <= g.t_issue < a.t_done)
    shards = dm.program.runtime.shards
    replicated = {n: p.detach().clone() for n, p in dm.module.named_parameters() if n not in shards}
    return {"losses": losses, "replicated": replicated, "violations": violations, "high": len(high), "low": len(low)}


def lina_stress(rank: int, world_size: int, steps: int) -> dict:
    """The same training twice in one world: calm, then with random per-rank delays."""
    calm = _lina_training(rank, world_size, steps, delays=False)
    stressed = _lina_training(rank, world_size, steps, delays=True)
    return {"calm": calm, "stressed": stressed}


def hf_backend_and_distribute(rank: int, world_size: int, family: str, passes: str) -> dict:
    """A raw HF model with labels=: HF computes its own loss. Once through
    torch.compile(backend=commfx.backend(plan)) (graph breaks allowed), once through
    commfx.distribute with keyword inputs."""
    import copy

    import commfx

    model, (ids,) = load_model(f"hf:{family}", dtype=torch.float64, batch=2 * world_size)
    plan = Plan.from_cli(passes, world_size=world_size)
    local = split_batch(ids, world_size, rank)
    results = {}

    compiled_model = copy.deepcopy(model)
    out = torch.compile(compiled_model, backend=commfx.backend(plan))(input_ids=local, labels=local)
    out.loss.backward()
    results["backend"] = {
        "type": type(out).__name__,
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        "grads": {n: p.grad.clone() for n, p in compiled_model.named_parameters() if p.grad is not None},
    }

    dm = commfx.distribute(copy.deepcopy(model), plan, {"input_ids": local, "labels": local})
    out = dm(input_ids=local, labels=local)
    out.loss.backward()
    results["distribute"] = {
        "type": type(out).__name__,
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        "grads": {n.removeprefix("module."): p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None},
        "placement": dm.placement,
    }
    return results


def raises_on_one_rank(rank: int, world_size: int, raising_rank: int) -> str:
    """User code that raises on one rank while its peers wait in a collective."""
    import torch.distributed as dist

    if rank == raising_rank:
        raise ValueError(f"the model factory failed on rank {rank}")
    dist.barrier()
    return "finished"


def hangs_before_distribute(rank: int, world_size: int, hanging_rank: int) -> str:
    """User code that hangs on one rank before distribute: the others wait at the rendezvous."""
    import dataclasses
    import time

    model, (ids,) = load_model("gpt-moe-tiny")
    if rank == hanging_rank:
        time.sleep(3600)  # a user's data loader stuck on a file lock, say
    plan = dataclasses.replace(Plan.from_cli("lift,expert_parallel", world_size=world_size), collective_timeout_s=4.0)
    distribute(model, plan, (split_batch(ids, world_size, rank),))
    return "finished"


def changing_shapes(rank: int, world_size: int, spec: str) -> dict:
    """distribute once, then call with other sequence lengths and batch sizes (this rank's
    batch sizes differ from its peers')."""
    model, (ids,) = load_model(spec, dtype=torch.float64, batch=4, seq=16)
    dm = distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size), (split_batch(ids, world_size, rank),))
    outputs = []
    for batch, seq in [(4, 16), (4, 12), (6 + rank, 9), (4, 16)]:
        generator = torch.Generator().manual_seed(100 * batch + seq)
        new = torch.randint(0, 32, (batch, seq), generator=generator)
        out = dm(new)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logits.sum().backward()
        outputs.append((new, logits.detach()))
    grads = {n.removeprefix("module."): p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None}
    return {"outputs": outputs, "lowered": len(dm._compiled), "grads": grads, "placement": dm.placement}


def backend_shapes(rank: int, world_size: int, dynamic) -> dict:
    """torch.compile with the commfx backend; new shapes arrive, on one rank only at step 2.
    Each step: ids, probe, output and gradients; each backend compile: the collectives it
    ran, and its forward graph's all-to-alls."""
    from unittest import mock

    import torch.distributed as dist

    import commfx

    model, _ = load_model("gpt-moe-tiny", dtype=torch.float64)
    be = commfx.backend(Plan.from_cli("lift,expert_parallel,partition_a2a:k=2", world_size=world_size))
    compiles = []

    def counting(gm, example_inputs):
        calls = []
        names = ("all_gather_object", "all_reduce", "all_to_all_single", "broadcast", "barrier", "monitored_barrier", "isend", "irecv", "new_group")
        patches = [mock.patch.object(dist, n, lambda *a, _n=n, _f=getattr(dist, n), **k: calls.append(_n) or _f(*a, **k)) for n in names]
        for patch in patches:
            patch.start()
        try:
            return be(gm, example_inputs)
        finally:
            for patch in patches:
                patch.stop()
            compiles.append(calls)

    compiled = torch.compile(model, backend=counting, dynamic=dynamic)
    shapes = [(2, 16), (3 if rank == 0 else 2, 16), (3, 12)]
    steps = []
    for step, (batch, seq) in enumerate(shapes):
        ids = torch.randint(0, 32, (batch, seq), generator=torch.Generator().manual_seed(10 * rank + batch + seq))
        probe = torch.randn((batch, seq, 32), generator=torch.Generator().manual_seed(100 * rank + step), dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        out = compiled(ids)
        (out * probe).sum().backward()
        steps.append({"ids": ids, "probe": probe, "output": out.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    a2a = torch.ops.commfx.all_to_all_start.default
    return {"steps": steps, "compiles": compiles, "all_to_alls": [sum(n.target is a2a for n in g["forward"].graph.nodes) for g in be.graphs]}


def empty_rank(rank: int, world_size: int, spec: str) -> dict:
    """The global batch has fewer rows than ranks: the last rank gets none and still takes
    part in every collective."""
    model, (ids,) = load_model(spec, dtype=torch.float64, batch=world_size - 1)
    local = split_batch(ids, world_size, rank)
    dm = distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size), (local,))
    out = dm(local)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    logits.sum().backward()
    grads = {n.removeprefix("module."): p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None}
    return {"rows": local.shape[0], "logits": logits.detach(), "grads": grads, "placement": dm.placement}


def dispatch_rows(rank: int, world_size: int, passes: str) -> dict:
    """Rows this rank's dispatch all-to-alls send, and the unique (token, rank) pairs of its
    routing (from the routers' own top-k, recorded by a forward hook on the eager model)."""
    from commfx.models.gpt_moe import TopKRouter

    model, (ids,) = load_model("gpt-moe", batch=4)
    local = split_batch(ids, world_size, rank)
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(out[1])) for m in model.modules() if isinstance(m, TopKRouter)]
    model(local)
    for hook in hooks:
        hook.remove()
    experts_per_rank = model.config.num_experts // world_size
    unique = sum(len(set(row.tolist())) for indices in chosen for row in indices // experts_per_rank)
    dm = distribute(model, Plan.from_cli(passes, world_size=world_size), (local,))
    dm.scheduler.records = []
    dm(local)
    # Token rows: a packed dispatch row also carries its routing weights and local ids.
    token_rows = [r for r in dm.scheduler.records if r.kind == "all_to_all" and r.row_shape[0] >= model.config.hidden_size]
    dispatches = token_rows[0::2]  # each MoE layer: the dispatch, then the combine
    return {"tokens": local.numel(), "dispatch_rows": sum(sum(r.send_rows) for r in dispatches), "unique_token_rank_pairs": unique}


def tp_against_dtensor(rank: int, world_size: int, spec: str) -> dict:
    """The same HF model split by commfx's tensor_parallel pass and by torch's own
    ColwiseParallel/RowwiseParallel (DTensor, parallelize_module on a gloo DeviceMesh):
    outputs and this rank's gradient shards, side by side."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from commfx.models.hf import training_forward

    model, (ids,) = load_model(spec, dtype=torch.float64)
    plan = Plan.from_cli("lift,tensor_parallel", world_size=world_size, tp=world_size)
    dm = distribute(model, plan, (ids,))
    out = dm(ids).logits
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * probe).sum().backward()
    ours = {n: p.grad.detach().clone() for n, p in dm.module.named_parameters()}

    reference, _ = load_model(spec, dtype=torch.float64)
    mesh = init_device_mesh("cpu", (world_size,))
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in reference.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    with training_forward(reference):
        theirs_out = reference(ids).logits
    (theirs_out * probe).sum().backward()
    theirs = {}
    for name, p in reference.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        theirs[name] = grad.detach().clone()
    return {
        "output_diff": (out - theirs_out).abs().max().item(),
        "grad_diffs": {n: (ours[n] - theirs[n]).abs().max().item() for n in ours},
        "sharded": sorted(n for n, p in dm.module.named_parameters() if isinstance(dm.placement.get(n), dict)),
        "shapes_equal": all(ours[n].shape == theirs[n].shape for n in ours),
    }


def hangs_between_steps(rank: int, world_size: int, hanging_rank: int) -> str:
    """User code that hangs on one rank after distribute, between two steps: the others wait in
    the first collective of the next step."""
    import dataclasses
    import time

    model, (ids,) = load_model("gpt-moe-tiny")
    plan = dataclasses.replace(Plan.from_cli("lift,expert_parallel", world_size=world_size), collective_timeout_s=4.0)
    local = split_batch(ids, world_size, rank)
    dm = distribute(model, plan, (local,))
    for step in range(2):
        if step == 1 and rank == hanging_rank:
            time.sleep(3600)  # a user's evaluation callback that never returns, say
        dm(local).sum().backward()
    return "finished"


def sum_of_ranks(rank: int, world_size: int) -> int:
    """The smallest job: every rank joins the world and all-reduces its rank."""
    import torch.distributed as dist

    total = torch.tensor([rank])
    dist.all_reduce(total)
    return int(total)


def diverging_replicas(rank: int, world_size: int, replicas: str) -> dict:
    """Each rank builds the model from its own seed, as a script that forgets to seed would."""
    from commfx.plan import PlanError
    from commfx.runtime.replicas import digest

    model, (ids,) = load_model("gpt-moe-tiny", seed=rank)
    try:
        dm = distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size), (split_batch(ids, world_size, rank),), replicas=replicas)
    except PlanError as error:
        return {"error": str(error)}
    return {"digests": {name: digest(p) for name, p in dm.named_parameters() if "experts" not in name}}


def recapture_for_labels(rank: int, world_size: int, spec: str, passes: str, tp: int) -> dict:
    """distribute an HF model with input_ids only, then train with labels= (a re-capture) and
    alternate with eval calls without them (both programs cached); one SGD step in between
    must reach both programs (the parameters are shared)."""
    import contextlib
    import gc
    import io
    import weakref

    model, (ids,) = load_model(spec, dtype=torch.float64, batch=2 * world_size)
    local = split_batch(ids, world_size // tp, rank // tp)  # a tensor-parallel group reads the same rows
    full = {n: weakref.ref(p) for n, p in model.named_parameters()}
    dm = distribute(model, Plan.from_cli(passes, world_size=world_size, tp=tp), (local,))
    del model  # the module keeps no full-size copy (a skeleton with stand-ins re-captures)
    gc.collect()
    full_alive = sorted(n for n in dm.placement if full[n]() is not None)
    params_before = [(n, id(p)) for n, p in dm.named_parameters()]
    keys_before = list(dm.state_dict())
    optimizer = torch.optim.SGD(dm.parameters(), lr=0.5)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        with torch.no_grad():
            first_eval = dm(input_ids=local).logits  # the captured inputs
        out = dm(input_ids=local, labels=local)  # new inputs: re-captured
        out.loss.backward()
        grads = {n.removeprefix("module."): p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            eval_after = dm(input_ids=local).logits  # cached; sees the step
        again = dm(input_ids=local, labels=local)  # cached
        again.loss.backward()
    return {
        "type": type(out).__name__,
        "first_eval": first_eval,
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        "grads": grads,
        "eval_after": eval_after,
        "loss_after": again.loss.detach(),
        "grads_after": {n.removeprefix("module."): p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None},
        "captures": [sorted(names) for names in dm._captures],
        "same_parameters": [(n, id(p)) for n, p in dm.named_parameters()] == params_before,
        "own_parameters": all(
            id(p) in {id(q) for q in dm.parameters()} for c in dm._captures.values() for p in c.gm.parameters()
        ),
        "same_keys": list(dm.state_dict()) == keys_before,
        "stderr": stderr.getvalue(),
        "placement": dm.placement,
        "full_alive": full_alive,
        "rows": local,
    }


def recapture_refused(rank: int, world_size: int, cases: list) -> dict:
    """A plan whose pass keeps runtime state by op id refuses a new set of inputs by name; so
    does a module at its max_captures, and every rank when the ranks call with different inputs."""
    model, (ids,) = load_model("hf:olmoe", dtype=torch.float64, batch=2 * world_size)
    local = split_batch(ids, world_size, rank)
    errors = {}
    for passes in cases:
        dm = distribute(model, Plan.from_cli(passes, world_size=world_size), (local,))
        try:
            dm(input_ids=local, labels=local)
            errors[passes] = ""
        except TypeError as error:
            errors[passes] = str(error)
    dm = distribute(model, Plan.from_cli("lift,expert_parallel", world_size=world_size), (local,))
    dm.max_captures = 1
    try:
        dm(input_ids=local, labels=local)
    except RuntimeError as error:
        errors["max_captures"] = str(error)
    dm.max_captures = 4
    other = {"labels": local} if rank == 0 else {"attention_mask": torch.ones_like(local)}
    try:
        dm(input_ids=local, **other)  # ranks disagree: refused on every rank before any captures
    except TypeError as error:
        errors["spmd"] = str(error)
    return errors


def measured_machine(rank: int, world_size: int) -> dict:
    """Plan(machine="measure") on gpt-moe-tiny with partition_a2a's k left to the cost model:
    the figures each rank compiled with, and the chunks it chose."""
    import dataclasses

    model, (ids,) = load_model("gpt-moe-tiny")
    local = (split_batch(ids, world_size, rank),)
    plan = dataclasses.replace(Plan.from_cli("lift,expert_parallel,partition_a2a", world_size=world_size), machine="measure")
    dm = distribute(model, plan, local)
    dm(*local).sum().backward()  # the measured plan trains
    chunks = sorted({n.args[-1].rsplit(" ", 1)[-1] for n in dm.module.graph.nodes if "all_to_all" in str(n.target) and isinstance(n.args[-1], str)})
    return {
        "notes": [n for n in dm.program.notes if n.startswith("machine measured")],
        "chunks": chunks,
        "probe_bytes": sum(v for k, v in dm.scheduler.stats.intra_node_bytes.items() if k == "machine_probe"),
    }
