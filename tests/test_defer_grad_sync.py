"""defer_grad_sync: the gradient all-reduce runs on into the next forward, each parameter
stepped at its first use there. Lossless: losses and parameters after 3 SGD (momentum,
weight decay) and 3 AdamW steps, under an LR scheduler, equal the plan without it (float64),
alone and under partition_a2a's priority lanes, with gradient accumulation over micro-batches,
and as state_dict reads them; and the plan errors."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from commfx.models import load_model
from commfx.compiler.pass_manager import check_plan
from commfx.plan import Plan, PlanError
from commfx.runtime.launcher import launch

BASE = "lift,expert_parallel"
LINA = "lift,expert_parallel,partition_a2a:k=2;grad_chunk_bytes=1024"


def _check_equal(results, pairs):
    for plain, deferred in pairs:
        for rank, result in enumerate(results):
            for optimizer in ("sgd", "adamw"):
                want, got = result[plain][optimizer], result[deferred][optimizer]
                assert want["caught_up"] == 0 and got["caught_up"] > 0, (deferred, optimizer, got["caught_up"])
                assert got["pending_before_sync"]  # the last step's gradients were still on the wire
                torch.testing.assert_close(got["losses"], want["losses"], rtol=0, atol=1e-12)
                for name, value in want["params"].items():
                    torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-12, msg=f"rank {rank} {deferred} {optimizer} {name}")
                    torch.testing.assert_close(got["saved"][name], value, rtol=0, atol=1e-12, msg=f"state_dict {deferred} {name}")


@pytest.mark.distributed
def test_deferred_steps_equal_steps_after_a_full_backward():
    plans = [BASE, f"{BASE},defer_grad_sync", LINA, f"{LINA},defer_grad_sync"]
    results = launch("defer_workers:train_each_plan", 2, {"plans": plans}, timeout_s=300, collective_timeout_s=60)
    _check_equal(results, ((BASE, f"{BASE},defer_grad_sync"), (LINA, f"{LINA},defer_grad_sync")))


@pytest.mark.distributed
def test_a_weight_tied_between_embedding_and_head_is_stepped_late_exactly():
    """An HF model (OLMoE, as transformers builds it) whose LM head shares the embedding's
    weight: one parameter whose gradient sums both uses, stepped late."""
    plans = [BASE, f"{BASE},defer_grad_sync"]
    args = {"plans": plans, "tied": True, "model_spec": "hf:olmoe"}
    results = launch("defer_workers:train_each_plan", 2, args, timeout_s=300, collective_timeout_s=60)
    _check_equal(results, ((BASE, f"{BASE},defer_grad_sync"),))


@pytest.mark.distributed
def test_deferred_gradients_accumulate_over_micro_batches():
    """Two backward passes per step: the first one's deferred gradients are settled into
    .grad by the second (no step came between), the second's are stepped late."""
    plans = [BASE, f"{BASE},defer_grad_sync"]
    results = launch("defer_workers:train_each_plan", 2, {"plans": plans, "micro_batches": 2}, timeout_s=300, collective_timeout_s=60)
    _check_equal(results, ((BASE, f"{BASE},defer_grad_sync"),))


@pytest.mark.parametrize(
    "passes, topology, message",
    [
        ("lift,pipeline_split,defer_grad_sync", {"pp": 2}, "defer_grad_sync does not work with pipeline_split"),
        ("lift,tensor_parallel,resize_tp,defer_grad_sync", {"tp": 2}, "defer_grad_sync does not work with resize_tp"),
        ("lift,defer_grad_sync,pipeline_split", {"pp": 2}, "pipeline_split does not work with defer_grad_sync yet: a pipeline stage"),
        ("lift,tensor_parallel,defer_grad_sync,resize_tp", {"tp": 2}, "resize_tp does not work with defer_grad_sync yet: both act"),
    ],
)
def test_defer_grad_sync_plan_errors(passes, topology, message):
    """In either order: the facts each side refuses."""
    model, _ = load_model("gpt-moe")
    with pytest.raises(PlanError, match=message):
        check_plan(Plan.from_cli(passes, world_size=2, **topology), model)


def test_defer_grad_sync_under_torch_compile_is_a_plan_error():
    from commfx.backend import backend

    with pytest.raises(PlanError, match="defer_grad_sync needs commfx.distribute"):
        backend(Plan.from_cli("lift,expert_parallel,defer_grad_sync", world_size=2))


def test_a_second_step_while_gradients_are_on_the_wire_says_to_synchronize():
    """optimizer.step() twice with no forward or backward between, while a deferred gradient
    is still in flight: the first step's missed update would be lost, so it is an error."""
    from types import SimpleNamespace

    from commfx.runtime.deferred_step import DeferredStep

    param = torch.nn.Parameter(torch.zeros(3))
    sync = SimpleNamespace(in_flight={0: object()}, slots=[SimpleNamespace(param=param)], pending=True)
    deferred = DeferredStep(sync)
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.register_step_pre_hook(deferred._before_step)
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) twice while a gradient was still on the wire; call synchronize\(\) between"):
        optimizer.step()
