"""Functions the pack_experts tests run on every rank (imported by the worker processes)."""

import copy

import torch
import torch.distributed as dist

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.train import loss_fn
from commfx.verify import split_batch


def _experts_in_original_order(dm) -> dict[str, torch.Tensor]:
    """Every packed layer's full expert weights, expert e at row e whatever the placement."""
    out = {}
    for op_id, layer in sorted(dm.placements.layers.items()):
        for target in layer.weights:
            local = dm.module.get_parameter(target).detach()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local.contiguous())
            by_slot = torch.cat(parts)
            out[target] = by_slot[layer.slot_of]
    return out


def _train(dm, optimizer, local, steps, after_step=None):
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(dm(*local), local)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def train_packed(rank: int, world_size: int, passes: str, steps: int, checkpoint_after: int = 0) -> dict:
    """A float64 training run with Adam; with `checkpoint_after`, the state (module and
    optimizer) is saved after that step, loaded into a freshly distributed module, and the
    rest of the run is repeated from it."""
    model, (ids,) = load_model("gpt-moe", seed=5, batch=4, dtype=torch.float64)
    local = (split_batch(ids, world_size, rank),)
    plan = Plan.from_cli(passes, world_size=world_size)
    dm = distribute(model, plan, local)
    fresh_model = load_model("gpt-moe", seed=5, batch=4, dtype=torch.float64)[0] if checkpoint_after else None
    optimizer = torch.optim.Adam(dm.parameters(), lr=3e-3)
    dm.attach_optimizer(optimizer)
    losses = _train(dm, optimizer, local, checkpoint_after or steps)
    result = {}
    if checkpoint_after:
        module_state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in dm.state_dict().items()}
        optimizer_state = copy.deepcopy(optimizer.state_dict())  # Adam updates its state in place
        saved_stats = {k: v["stats"]["load"].sum().item() for k, v in dm.placements.state().items()}
        rest = _train(dm, optimizer, local, steps - checkpoint_after)
        resumed = distribute(fresh_model, plan, local)
        resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=3e-3)
        resumed.attach_optimizer(resumed_optimizer)
        resumed.load_state_dict(module_state)
        resumed_optimizer.load_state_dict(optimizer_state)
        result["restored_stats"] = {k: v["stats"]["load"].sum().item() for k, v in resumed.placements.state().items()}
        result["saved_stats"] = saved_stats
        result["resumed_losses"] = losses + _train(resumed, resumed_optimizer, local, steps - checkpoint_after)
        result["resumed_experts"] = _experts_in_original_order(resumed)
        result["resumed_slot_of"] = {k: v.slot_of.tolist() for k, v in resumed.placements.layers.items()}
        result["resumed_moved"] = [[d.moved for d in decisions] for decisions in resumed.placement_log]
        losses += rest
    result.update(
        losses=losses,
        experts=_experts_in_original_order(dm),
        others={n: p.detach().clone() for n, p in dm.named_parameters() if "experts" not in n},
        slot_of={k: v.slot_of.tolist() for k, v in dm.placements.layers.items()},
        moved=[[d.moved for d in decisions] for decisions in dm.placement_log],
        colocated=[[(d.colocated_before, d.colocated_after) for d in decisions] for decisions in dm.placement_log],
        declined=[[(d.declined, d.payback_steps) for d in decisions] for decisions in dm.placement_log],
    )
    return result


def replacement_equivalence(rank: int, world_size: int, steps: int = 5) -> dict:
    """One run that never re-places, one that re-places every 2 steps whatever a move costs,
    checkpointed after step 3 and resumed into a fresh module, and one whose moves must
    repay themselves at once (payback=0: it declines them); all in this process, one launch."""
    never = train_packed(rank, world_size, "lift,expert_parallel,pack_experts", steps)
    moved = train_packed(rank, world_size, "lift,expert_parallel,pack_experts:replace_every=2;balance=0.5;payback=inf", steps,
                         checkpoint_after=3)
    declined = train_packed(rank, world_size, "lift,expert_parallel,pack_experts:replace_every=2;balance=0.5;payback=0", steps)
    return {"never": never, "moved": moved, "declined": declined}


def replacement_with_deferred_sync(rank: int, world_size: int, steps: int = 4) -> dict:
    """Under defer_grad_sync: a run that re-places every 2 steps against one that never
    does, and whether gradients other than the experts' were still on the wire right after
    each re-placing step (a re-placement settles only what it moves)."""
    runs = {}
    for name, passes in (("never", "lift,expert_parallel,pack_experts,defer_grad_sync"),
                         ("moved", "lift,expert_parallel,pack_experts:replace_every=2;balance=0.5,defer_grad_sync")):
        model, (ids,) = load_model("gpt-moe", seed=5, batch=4, dtype=torch.float64)
        local = (split_batch(ids, world_size, rank),)
        dm = distribute(model, Plan.from_cli(passes, world_size=world_size), local)
        optimizer = torch.optim.Adam(dm.parameters(), lr=3e-3)
        dm.attach_optimizer(optimizer)
        pending_after_replacement = []
        losses = _train(dm, optimizer, local, steps,
                        lambda step: (step + 1) % 2 == 0 and pending_after_replacement.append(dm.deferred.pending))
        dm.synchronize()
        runs[name] = dict(
            losses=losses, pending_after_replacement=pending_after_replacement,
            moved=[[d.moved for d in decisions] for decisions in dm.placement_log],
            experts=_experts_in_original_order(dm),
            others={n: p.detach().clone() for n, p in dm.named_parameters() if "experts" not in n},
        )
    return runs
