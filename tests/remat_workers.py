"""The rank function of tests/test_activation_budget.py: one training step of the built-in
gpt-moe under each activation memory budget, with what the lowered graphs saved and ran."""

import collections
import dataclasses

import torch
import torch.nn.functional as F

import commfx.api as api
from commfx.compiler.lower import compile_training
from commfx.compiler.remat import saved_activations
from commfx.models import load_model
from commfx.plan import Plan


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def step_under_budgets(rank: int, world_size: int, passes: str, budgets: list) -> list[dict]:
    """Per budget: the loss, every gradient, the bytes the forward saved for the backward,
    and the commfx ops the backward graph calls (a recomputed collective would add some)."""
    results = []
    for budget in budgets:
        graphs = {}

        def recording(gm, inputs, *, forward, backward, **kwargs):
            def keep(name, runner):
                def compile_one(graph):
                    graphs[name] = graph
                    return runner(graph)

                return compile_one

            return compile_training(gm, inputs, forward=keep("forward", forward), backward=keep("backward", backward), **kwargs)

        api.compile_training = recording  # distribute hands the compile function to the module it builds
        try:
            model, (ids,) = load_model("gpt-moe", dtype=torch.float64)
            plan = dataclasses.replace(Plan.from_cli(passes, world_size=world_size), activation_memory_budget=budget)
            dm = api.distribute(model, plan, (ids,))
            loss = next_token_loss(dm(ids), ids)
            loss.backward()
        finally:
            api.compile_training = compile_training
        saved = saved_activations(graphs["forward"], graphs["backward"])
        commfx_ops = collections.Counter(str(n.target) for n in graphs["backward"].graph.nodes if str(n.target).startswith("commfx."))
        results.append({
            "loss": loss.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in dm.module.named_parameters() if p.grad is not None},
            "saved_bytes": saved.bytes,
            "saved_tensors": saved.tensors,
            "backward_commfx_ops": dict(commfx_ops),
        })
    return results
