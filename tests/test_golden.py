"""Golden graphs: the rendered graph for each built-in model and pipeline stage.

The renderer is the one `commfx dump` uses. Regenerate on purpose and read the diff:
    COMMFX_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
Every golden file is declared with the test that reads it in tests/golden_files.py.
"""

import importlib

import pytest
from _pytest.mark.structures import ParameterSet

from commfx.api import compile_program
from commfx.compiler.lower import lower
from commfx.models import BUILTIN_MODELS, load_model
from commfx.plan import Plan
from commfx.compiler.render import render

import golden_files
from golden_files import GOLDEN

STAGES = golden_files.ALL_STAGES


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
    """Each stage's text equals tests/golden/<prefix>.<stage>.txt (see golden_files.check_golden)."""
    for stage in stages:
        golden_files.check_golden(f"{prefix}.{stage}", texts[stage])


def _parameter_ids(function) -> set[str] | None:
    """The ids of a test's single-argument parametrize marks (None when it has none)."""
    marks = [m for m in getattr(function, "pytestmark", []) if m.name == "parametrize"]
    if not marks:
        return None
    ids = set()
    for mark in marks:
        explicit = mark.kwargs.get("ids")
        for i, value in enumerate(mark.args[1]):
            if explicit is not None:
                ids.add(str(explicit[i]))
            elif isinstance(value, ParameterSet):
                ids.add(value.id if value.id is not None else str(value.values[0]))
            else:
                ids.add(str(value))
    return ids


def test_every_golden_file_has_a_reader():
    """tests/golden/ holds exactly the files golden_files.READERS declares, and every declared
    reader is a test that exists (with that parameter), so no golden can go unchecked."""
    on_disk = {path.name for path in GOLDEN.iterdir()}
    declared = {f"{name}.txt" for names in golden_files.READERS.values() for name in names}
    assert not on_disk - declared, f"golden files no test reads (declare a reader in tests/golden_files.py or delete them): {sorted(on_disk - declared)}"
    assert not declared - on_disk, f"declared golden files missing from tests/golden (create them with COMMFX_UPDATE_GOLDEN=1): {sorted(declared - on_disk)}"
    for test_id in golden_files.READERS:
        file_name, test = test_id.split("::")
        function_name, _, parameter = test.partition("[")
        module = importlib.import_module(file_name.removesuffix(".py"))
        function = getattr(module, function_name, None)
        assert callable(function), f"{test_id}: no test {function_name} in tests/{file_name}"
        ids = _parameter_ids(function)
        if parameter:
            assert ids is not None and parameter.removesuffix("]") in ids, f"{test_id}: {function_name} has no parameter {parameter[:-1]!r} (has {ids})"
        else:
            assert ids is None, f"{test_id}: {function_name} is parametrized; name the parameter ({sorted(ids)})"


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


# ---------------------------------------------------------------------------- the golden helper itself


@pytest.fixture
def scratch_golden(request, tmp_path, monkeypatch):
    """A golden 'scratch' in a temporary directory, declared for the running test."""
    monkeypatch.setattr(golden_files, "GOLDEN", tmp_path)
    monkeypatch.delenv(golden_files.UPDATE_VARIABLE, raising=False)
    test_id = f"{request.node.path.name}::{request.node.name}"
    monkeypatch.setitem(golden_files.READERS, test_id, ("scratch",))
    (tmp_path / "scratch.txt").write_text("line 1\nline 2\nline 3\n")
    return tmp_path / "scratch.txt"


def test_a_hand_edited_golden_fails_with_a_unified_diff(scratch_golden):
    golden_files.check_golden("scratch", "line 1\nline 2\nline 3\n")
    scratch_golden.write_text("line 1\nline 2 edited\nline 3\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        golden_files.check_golden("scratch", "line 1\nline 2\nline 3\n")
    message = str(failure.value)
    assert "--- tests/golden/scratch.txt\n+++ scratch (rendered now)" in message
    assert "-line 2 edited\n+line 2\n" in message


def test_only_update_flag_1_rewrites(scratch_golden, monkeypatch):
    for value in ("0", "true", "yes", " 1"):
        monkeypatch.setenv(golden_files.UPDATE_VARIABLE, value)
        with pytest.raises(pytest.fail.Exception, match="the only allowed value is 1"):
            golden_files.check_golden("scratch", "new\n")
        assert scratch_golden.read_text() == "line 1\nline 2\nline 3\n"
    monkeypatch.setenv(golden_files.UPDATE_VARIABLE, "1")
    golden_files.check_golden("scratch", "new\n")
    assert scratch_golden.read_text() == "new\n"


def test_a_golden_not_declared_for_the_test_is_refused(scratch_golden):
    (scratch_golden.parent / "other.txt").write_text("x\n")
    with pytest.raises(pytest.fail.Exception, match="does not declare for it"):
        golden_files.check_golden("other", "x\n")
