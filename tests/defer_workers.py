"""What every rank runs in the defer_grad_sync tests."""

import torch

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan
from commfx.train import loss_fn
from commfx.verify import split_batch

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1),
}
STEPS = 3


def train_each_plan(
    rank: int, world_size: int, plans: list[str], rows: int = 7, micro_batches: int = 1, tied: bool = False, model_spec: str = "gpt-moe-tiny"
) -> dict:
    """Per plan and optimizer: the losses of STEPS steps (an LR scheduler halving the rate
    after every step; each step accumulates gradients over `micro_batches` backward passes),
    the parameters after them (read through state_dict, which settles deferred updates, and
    after synchronize), and how many parameters were stepped late. `tied`: the LM head
    shares the embedding's weight, as many Hugging Face models do."""
    _, (ids,) = load_model(model_spec, dtype=torch.float64, batch=rows, seq=8)
    local = (split_batch(ids, world_size, rank),)
    results = {}
    for passes in plans:
        model, _ = load_model(model_spec, dtype=torch.float64, batch=rows, seq=8)
        if tied:
            model.lm_head.weight = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else model.embed.weight
        dm = distribute(model, Plan.from_cli(passes, world_size=world_size), local)
        start = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dm.state_dict().items()}
        result = {}
        for name, make in OPTIMIZERS.items():
            dm.load_state_dict(start)
            optimizer = make(dm.parameters())
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            dm.attach_optimizer(optimizer)
            caught_up = dm.deferred.caught_up if dm.deferred else 0
            losses = []
            for _ in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                for micro in torch.tensor_split(local[0], micro_batches):
                    loss = loss_fn(dm(micro), (micro,)) / micro_batches
                    loss.backward()
                    losses.append(loss.detach())
                optimizer.step()
                schedule.step()
            pending_before_sync = bool(dm.deferred and dm.deferred.pending)
            saved = {k.removeprefix("module."): v.clone() for k, v in dm.state_dict().items() if isinstance(v, torch.Tensor)}
            dm.synchronize()
            result[name] = {
                "losses": torch.stack(losses),
                "params": {n: p.detach().clone() for n, p in dm.module.named_parameters()},
                "saved": saved,
                "caught_up": (dm.deferred.caught_up if dm.deferred else 0) - caught_up,
                "pending_before_sync": pending_before_sync,
            }
        results[passes] = result
    return results
