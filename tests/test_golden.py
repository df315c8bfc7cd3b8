"""Golden graphs: the rendered graph for each built-in model and pipeline stage.

The renderer is the one `commfx dump` uses. Regenerate on purpose and read the diff:
    COMMFX_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import os
from pathlib import Path

import pytest

from commfx.api import compile_program
from commfx.compiler.lower import lower
from commfx.models import BUILTIN_MODELS, load_model
from commfx.plan import Plan
from commfx.compiler.render import render

GOLDEN = Path(__file__).parent / "golden"
STAGES = ("lifted", "distributed", "forward", "backward")


LINA = "lift,expert_parallel,partition_a2a:k=2"


def rendered(model_name: str, passes: str = "lift,expert_parallel") -> dict[str, str]:
    model, inputs = load_model(model_name)
    plan = Plan.from_cli(passes, world_size=4)
    lifted = compile_program(model, plan, inputs, stop_after="lift")
    texts = {"lifted": render(lifted.gm)}
    model, inputs = load_model(model_name)
    program = compile_program(model, plan, inputs)
    texts["distributed"] = render(program.gm)
    lowered = lower(program, inputs)
    texts["forward"], texts["backward"] = render(lowered.forward), render(lowered.backward)
    return texts


def check_golden(texts: dict[str, str], prefix: str, stages) -> None:
    """Each stage's text equals tests/golden/<prefix>.<stage>.txt (written under COMMFX_UPDATE_GOLDEN)."""
    for stage in stages:
        path = GOLDEN / f"{prefix}.{stage}.txt"
        if os.environ.get("COMMFX_UPDATE_GOLDEN"):
            path.write_text(texts[stage])
        assert path.exists(), f"{path} missing: run with COMMFX_UPDATE_GOLDEN=1 to create it"
        assert texts[stage] == path.read_text(), f"{path.name} changed; if on purpose, regenerate and review the diff"


@pytest.mark.parametrize("model_name", sorted(BUILTIN_MODELS))
def test_golden_graphs(model_name):
    check_golden(rendered(model_name), f"{model_name}.ep4", STAGES)


def test_golden_partitioned_graphs():
    """Lina's partitioned region (k=2): chunked, prioritised all-to-alls in forward and backward."""
    texts = rendered("gpt-moe-tiny", LINA)
    check_golden(texts, "gpt-moe-tiny.ep4.lina-k2", ("distributed", "forward", "backward"))
    for stage in ("forward", "backward"):
        starts = [line for line in texts[stage].splitlines() if "commfx.all_to_all_start(" in line]
        assert len(starts) == 4, starts  # dispatch and combine, 2 chunks each, one MoE layer
        assert all("'a2a'" in line for line in starts)
        assert texts[stage].count("commfx.wait_tensor(") == 4


def test_rendering_is_stable_run_to_run():
    first, second = rendered("gpt-moe-tiny"), rendered("gpt-moe-tiny")
    assert first == second


def test_backward_graph_holds_the_backward_all_to_alls():
    backward = rendered("gpt-moe-tiny")["backward"]
    assert backward.count("commfx.all_to_all_start(") == 2
    assert backward.count("commfx.wait_tensor(") == 2
    assert "commfx.expert_ffn_backward(" in backward


def test_golden_packed_graphs():
    """pack_experts: once-per-rank dispatch (token rows with their routing weights and local
    ids as extra columns), local fan-out and weighted sum at the expert rank, one row back:
    two all-to-alls in forward and in backward."""
    texts = rendered("gpt-moe-tiny", "lift,expert_parallel,pack_experts")
    check_golden(texts, "gpt-moe-tiny.ep4.packed", ("distributed", "forward", "backward"))
    distributed = texts["distributed"]
    assert "commfx.rank_dispatch(" in distributed and "commfx.scatter_add_tokens(" in distributed
    assert "commfx.group_by_expert(" not in distributed and "pack_experts:" in distributed
    assert "commfx.expert_slots(" in distributed  # the runtime's placement, not a constant
    for stage in ("forward", "backward"):
        assert texts[stage].count("commfx.all_to_all_start(") == 2, stage
    assert "commfx.attach_meta(" in distributed and "commfx.detach_meta(" in distributed


def test_golden_packed_and_chunked_graphs():
    """pack_experts then partition_a2a:k=2: the packed exchange in two chunks, each with its
    dispatch and combine all-to-alls (priority a2a), forward and backward; both chunks'
    dispatches start before the first chunk's experts run, so chunk 2's rows are on the wire
    while chunk 1 computes."""
    texts = rendered("gpt-moe-tiny", "lift,expert_parallel,pack_experts,partition_a2a:k=2")
    check_golden(texts, "gpt-moe-tiny.ep4.packed-k2", ("distributed", "forward", "backward"))
    assert "commfx.split_chunks(" in texts["distributed"] and "commfx.merge_chunks(" in texts["distributed"]
    assert "packed dispatch 2/2" in texts["distributed"]
    for stage in ("forward", "backward"):
        assert texts[stage].count("commfx.all_to_all_start(") == 4, stage
    forward = texts["forward"].splitlines()
    first_experts = next(i for i, line in enumerate(forward) if "commfx.packed_expert_ffn(" in line)
    dispatches = [i for i, line in enumerate(forward) if "commfx.all_to_all_start(" in line and "packed dispatch" in line]
    assert len(dispatches) == 2 and max(dispatches) < first_experts
