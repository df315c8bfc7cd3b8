"""The compile pipeline in one process: check the plan, capture the model, run the passes.

What comes out is a `Program` whose graph is the same on every rank (rank-dependent
values are runtime inputs); `lower.compile_training` then lowers it per input signature.
"""

from __future__ import annotations

import torch

from .pass_manager import PassObserver, check_plan, run_passes
from ..plan import Plan
from .capture import capture
from .precision import apply_precision
from .program import Program


def compile_program(
    model: torch.nn.Module,
    plan: Plan,
    example_inputs,
    example_kwargs: dict | None = None,
    *,
    stop_after: str | None = None,
    tokens_per_rank: int | None = None,
    observe: PassObserver | None = None,
    captured: Program | None = None,
) -> Program:
    """Validate the plan, capture the model and run the plan's passes (single process).

    `example_inputs`: a tuple of tensors, or a dict of keyword tensors; `example_kwargs`
    adds keyword tensors to a tuple (HF style: `(ids,), {"labels": ids}`).

    `tokens_per_rank` overrides what cost models assume (default: the example's tokens);
    `distribute` passes the world's largest so every rank makes the same choices.

    `observe`: see `run_passes` (called before and after each pass).

    `captured`: `capture`'s program of this model and inputs, to compile several plans from
    one trace (`commfx plan`); each compile rewrites its own copy.
    """
    check_plan(plan, model)
    program = captured.derive() if captured is not None else capture(model, example_inputs, example_kwargs)
    casts = apply_precision(program.gm, plan.precision)
    if casts:
        program.history.append(f"precision {plan.precision}: {casts} casts")
        program.notes.append(
            f"precision {plan.precision}: float32 parameters, matmuls in {plan.precision}; norms, softmax, router and loss in float32"
        )
    if tokens_per_rank is not None:
        program.tokens_per_rank = tokens_per_rank
    return run_passes(program, plan, stop_after=stop_after, observe=observe)
