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
    dm = distribute(model, Plan.from_cli("lift,tensor_parallel,resize_tp:window=2;tolerance=inf", world_size=world_size, tp=world_size), (ids,))
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
    result["kept"] = {key: resizer.plan(key).columns.kept for key in resizer.linears}
    state = copy.deepcopy(dm.state_dict())
    resizer.restore()
    dm.load_state_dict(state)
    result["kept_after_load"] = {key: resizer.plan(key).columns.kept for key in resizer.linears}
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


# ----------------------------------------------------------------------- unit migration


class _Attention(torch.nn.Module):
    """Separate q/k/v (q and v biased) or a fused qkv: both column shapes a unit must cover."""

    def __init__(self, hidden, heads, fused):
        super().__init__()
        self.heads, self.fused = heads, fused
        if fused:
            self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        else:
            # no k bias: softmax cancels it, so its gradient is rounding noise that Adam amplifies
            self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden, bias=name != "k") for name in "qkv")
        self.o = torch.nn.Linear(hidden, hidden)

    def forward(self, h):
        b, s, d = h.shape
        if self.fused:
            q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        else:
            q, k, v = (f(h).view(b, s, self.heads, d // self.heads) for f in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class _Layer(torch.nn.Module):
    def __init__(self, hidden, heads, mlp, fused):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads, fused)
        self.mlp = _Mlp(hidden, mlp)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class _Mlp(torch.nn.Module):
    def __init__(self, hidden, mlp):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, mlp), torch.nn.Linear(mlp, hidden)

    def forward(self, h):
        return self.down(torch.nn.functional.gelu(self.up(h)))


class DenseTiny(torch.nn.Module):
    """A dense GPT small enough for float64 tests: every block tensor-parallel."""

    def __init__(self, vocab=32, hidden=32, heads=8, mlp=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList([_Layer(hidden, heads, mlp, fused=False), _Layer(hidden, heads, mlp, fused=True)])
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def dense_tiny():
    torch.manual_seed(0)
    model = DenseTiny().double()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, ids


def _full_grads(dm):
    """Every local gradient as the giver would hold it: the taker's slot gradients summed back
    into the giver's slices (collective), so runs with and without migration compare."""
    grads = {n: p.grad.detach().clone() for n, p in dm.module.named_parameters() if p.grad is not None}
    resizer = dm.straggler.resizer if dm.straggler is not None else None
    migration = resizer.unit_migration if resizer is not None else None
    if migration:
        for key in sorted(migration["counts"]):
            block, count = resizer.units[key], migration["counts"][key]
            for (name, dim, layout), slot in zip(block.tensors, block.slots):
                index = block.index(layout, block.units - count, count)
                shape = list(resizer.params[name].shape)
                shape[dim] = index.numel()
                buffer = torch.zeros(shape, dtype=torch.float64)
                if resizer.tp_rank == migration["taker"]:
                    buffer.copy_(slot.grad)
                dm.scheduler.all_reduce(buffer, "tp", kind="test")
                if resizer.tp_rank == migration["giver"]:
                    assert grads[name].index_select(dim, index).abs().max() == 0  # the giver computed none of them
                    grads[name].index_copy_(dim, index, buffer)
    return grads


def _unit_step(dm, ids, probe):
    out = dm(ids)
    (out * probe).sum().backward()
    result = out.detach(), _full_grads(dm)
    dm.zero_grad(set_to_none=True)
    return result


def _params(dm):
    return {n: p.detach().clone() for n, p in dm.module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _adamw_twice(dm, ids, probe, start: dict, steps: int, before_step) -> tuple[dict, torch.optim.Optimizer]:
    """`steps` AdamW steps (weight decay on) from `start`, `before_step(step)` called before
    each forward; the parameters after, and the optimizer (attached to the module)."""
    dm.load_state_dict(start)
    optimizer = torch.optim.AdamW(dm.parameters(), lr=1e-2, weight_decay=0.1)
    dm.attach_optimizer(optimizer)
    for step in range(steps):
        before_step(step)
        out = dm(ids)
        (out * probe).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _params(dm), optimizer


def unit_suite(rank: int, world_size: int) -> dict:
    model, ids = dense_tiny()
    probe = torch.randn((*ids.shape, 32), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    plain = distribute(copy.deepcopy(model), Plan.from_cli("lift,tensor_parallel", world_size=world_size, tp=world_size), (ids,))
    dm = distribute(model, Plan.from_cli("lift,tensor_parallel,resize_tp:window=2;tolerance=inf", world_size=world_size, tp=world_size), (ids,))
    controller, resizer = dm.straggler, dm.straggler.resizer
    controller.adjust = lambda step, seconds: 0.1 * controller.my_work()  # the same speed everywhere: no decision
    result = {"blocks": {k: (b.units, b.unit) for k, b in resizer.units.items()}, "mode": controller.config.migrate}
    reference = _unit_step(plain, ids, probe)
    result["plain_untouched"] = _diff(reference, _unit_step(dm, ids, probe))

    # The last rank gives most of its units to rank 0 (heads and MLP column blocks, every block).
    giver, taker = world_size - 1, 0
    counts = {k: b.units - 1 for k, b in resizer.units.items()}
    before = _params(dm)
    result["moved_bytes"] = resizer.move_units(giver, taker, counts)
    result["slot_sizes"] = [tuple(p.shape) for p in resizer.slots.parameters()]
    migrated = _unit_step(dm, ids, probe)
    result["migrated"] = _diff(reference, migrated)
    # the same through the general path (a resize that keeps every column, with units given)
    resizer.resize(1.0, kept={key: list(range(resizer.plan(key).width)) for key in resizer.linears})
    result["migrated_general"] = _diff(reference, _unit_step(dm, ids, probe))
    resizer.resize(1.0)
    records = _records(dm, ids, probe)
    result["records_match"] = records == _records(plain, ids, probe)
    # no traffic per step beyond plain tp's own collectives
    result["records_kinds"] = sorted({r[0] for r in records})
    resizer.move_units(0, 0, {})
    result["undo_exact"] = all(torch.equal(before[n], p) for n, p in _params(dm).items())
    result["slots_empty_after_undo"] = all(p.numel() == 0 for p in resizer.slots.parameters())
    result["plans_plain_after_undo"] = all(resizer.plan(k).is_plain() for k in resizer.linears) and not any(b.taken for b in resizer.units.values())
    result["restored"] = _diff(reference, _unit_step(dm, ids, probe))

    # AdamW (weight decay on): 5 steps without migration, and with units moved after step 1
    # (optimizer state moves with them), moved differently after step 2, moved back after step 4.
    start = copy.deepcopy(dm.state_dict())
    moves = {1: (giver, taker, counts), 2: (giver, taker, {k: 1 for k in counts}), 4: (0, 0, {})}
    plain_run, _ = _adamw_twice(dm, ids, probe, start, 5, lambda step: None)
    migrated_run, optimizer = _adamw_twice(dm, ids, probe, start, 5, lambda step: step in moves and resizer.move_units(*moves[step]))
    result["slot_state_after_undo"] = sum(1 for p in resizer.slots.parameters() if p in optimizer.state)
    result["training_diff"] = _max_diff(plain_run, migrated_run)
    # an optimizer over the inner module's parameters would never train the slots: refused
    dm.attach_optimizer(torch.optim.AdamW(dm.module.parameters(), lr=1e-2))
    try:
        resizer.move_units(giver, taker, counts)
        result["unoptimized_slots_error"] = ""
    except ValueError as error:
        result["unoptimized_slots_error"] = str(error)
    resizer.optimizer = None

    # state_dict while migrated: the layout and the slots come back with it.
    dm.load_state_dict(start)
    resizer.move_units(giver, taker, counts)
    saved = copy.deepcopy(dm.state_dict())
    out_saved = dm(ids).detach()
    resizer.move_units(0, 0, {})
    dm.load_state_dict(saved)
    result["layout_after_load"] = resizer.unit_migration
    result["layout_saved"] = {"giver": giver, "taker": taker, "counts": counts}
    result["load_diff"] = (dm(ids).detach() - out_saved).abs().max().item()
    result["load_vs_reference"] = (dm(ids).detach() - reference[0]).abs().max().item()
    resizer.move_units(0, 0, {})
    dm.load_state_dict(start)

    result.update(_unit_resizing(dm, plain, ids, probe, reference, giver))

    # The controller on unit migration: rank `giver` 2.5x slower for 8 steps, then recovered;
    # noisy clocks per rank, the same decisions everywhere; units move at a step's start.
    noise = random.Random(1000 + rank)

    def synthetic(step, _seconds):
        slow = 2.5 if resizer.tp_rank == giver and step < 8 else 1.0
        return 0.1 * slow * controller.my_work() * (1 + noise.uniform(-0.05, 0.05))

    controller.adjust = synthetic
    controller.decisions.clear()
    controller.state = SemiState()
    layouts = []
    for _ in range(12):
        _step(dm, ids, probe)
        layouts.append(resizer.unit_migration)
    result["decisions"] = [d.line() for d in controller.decisions]
    result["actions"] = [d.action for d in controller.decisions]
    result["layouts"] = layouts
    result["restored_at_end"] = resizer.unit_migration is None and resizer.fraction == 1.0 and resizer.unit_kept is None and not resizer.unit_order
    result["restored_exact"] = _diff(reference, _unit_step(dm, ids, probe))
    return result


def _unit_resizing(dm, plain, ids, probe, reference, giver) -> dict:
    """Unit resizing on rank `giver`: it keeps half its units, those of largest weights moved
    to the front of its shard. The same as plain tp with the dropped units' column rows
    zeroed (in the permuted layout); their gradients are zero; no collective changes shape;
    full width puts every unit back bit for bit; the layout survives state_dict; AdamW with
    the shard permuted between steps (optimizer state moved along) equals AdamW without."""
    resizer, result = dm.straggler.resizer, {}
    me = resizer.tp_rank == giver
    before = _params(dm)
    scores = {key: [sum(float(resizer.params[name].detach().index_select(dim, block.index(layout, u, 1)).pow(2).sum())
                        for name, dim, layout in block.tensors) for u in range(block.units)] for key, block in resizer.units.items()}
    records_plain = _records(dm, ids, probe)
    order = lambda key: resizer.unit_order.get(key, list(range(resizer.units[key].units)))  # noqa: E731
    resizer.resize_units(0.5 if me else 1.0)
    result["unit_kept"] = resizer.unit_kept
    # the kept units are the largest: none dropped scores above one kept
    result["kept_by_priority"] = all(
        min(scores[key][u] for u in order(key)[:kept]) >= max(scores[key][u] for u in order(key)[kept:])
        for key, kept in (resizer.unit_kept or {}).items())
    result["reordered"] = sorted(resizer.unit_order)
    result["unit_records_match"] = _records(dm, ids, probe) == records_plain
    zeroed, plain_params = plain, _params(plain)  # plain tp, its weights set to the resized rank's, then put back
    mask = {}
    with torch.no_grad():
        params = dict(zeroed.module.named_parameters())
        for name, p in dm.module.named_parameters():
            params[name].copy_(p)
        for key, kept in (resizer.unit_kept or {}).items():
            block = resizer.units[key]
            for name, dim, layout in block.tensors:
                index = block.index(layout, kept, block.units - kept)
                mask[name] = (dim, index)
                if dim == 0:  # column rows of the dropped units: their activations are zero
                    params[name].index_fill_(0, index, 0.0)
    out, grads = _unit_step(dm, ids, probe)
    ref_out, ref_grads = _unit_step(zeroed, ids, probe)
    result["dropped_grads_zero"] = True
    for name, (dim, index) in mask.items():
        result["dropped_grads_zero"] &= bool(grads[name].index_select(dim, index).abs().max() == 0)
        ref_grads[name].index_fill_(dim, index, 0.0)
    result["unit_resized"] = _diff((ref_out, ref_grads), (out, grads))
    with torch.no_grad():
        for name, p in zeroed.module.named_parameters():
            p.copy_(plain_params[name])
    result["unit_resized_changes_output"] = (out - reference[0]).abs().max().item()
    result["unit_error"] = resizer.error()
    saved = copy.deepcopy(dm.state_dict())
    resizer.resize_units(1.0)
    result["unit_restore_exact"] = all(torch.equal(before[n], p) for n, p in _params(dm).items()) and not resizer.unit_order
    dm.load_state_dict(saved)
    result["unit_load_diff"] = (dm(ids).detach() - out).abs().max().item()
    result["unit_kept_after_load"] = resizer.unit_kept
    resizer.resize_units(1.0)

    # AdamW: the shard permuted (reversed units) after step 1, put back after step 3
    start = copy.deepcopy(dm.state_dict())

    def permute(step):
        if step == 1 and me:
            for key, block in resizer.units.items():
                resizer._permute(key, block, list(reversed(range(block.units))))
        if step == 3:
            resizer.resize_units(1.0)

    plain_run, _ = _adamw_twice(dm, ids, probe, start, 4, lambda step: None)
    result["unit_permuted_training_diff"] = _max_diff(plain_run, _adamw_twice(dm, ids, probe, start, 4, permute)[0])
    resizer.optimizer = None
    dm.load_state_dict(start)
    return result


def hf_unit_check(rank: int, world_size: int, spec: str = "hf:llama", heads: int = 0, kv_heads: int = 0) -> dict:
    """An HF model (grouped-query attention, gated MLP): its units moved from the last rank to
    rank 0, outputs and gradients against plain tensor parallelism, float64. `heads` and
    `kv_heads` override the family's tiny config (enough kv groups per rank to move one)."""
    if heads:
        from transformers import AutoModelForCausalLM

        from commfx.models.hf import hf_config

        config = hf_config(spec[3:])
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv_heads, config.hidden_size // heads
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).double().train()
        ids = torch.randint(0, config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    else:
        model, (ids,) = load_model(spec, dtype=torch.float64)
    plain = distribute(copy.deepcopy(model), Plan.from_cli("lift,tensor_parallel", world_size=world_size, tp=world_size), (ids,))
    dm = distribute(model, Plan.from_cli("lift,tensor_parallel,resize_tp:mode=off", world_size=world_size, tp=world_size), (ids,))
    resizer = dm.straggler.resizer

    def step(module):
        out = module(ids).logits
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (out * probe).sum().backward()
        result = out.detach(), _full_grads(module)
        module.zero_grad(set_to_none=True)
        return result

    reference = step(plain)
    resizer.move_units(world_size - 1, 0, {k: b.units - 1 for k, b in resizer.units.items()})
    migrated = step(dm)
    resizer.move_units(0, 0, {})
    moved = {k: b.units - 1 for k, b in resizer.units.items() if b.units > 1}
    return {"blocks": sorted(resizer.units), "moved": moved, "migrated": _diff(reference, migrated), "restored": _diff(reference, step(dm))}
