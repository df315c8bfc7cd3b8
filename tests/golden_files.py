"""Golden files: the one helper every test uses to compare (or, on purpose, rewrite) tests/golden/.

A golden is compared with the text the code renders now; a difference fails with a unified
diff. `COMMFX_UPDATE_GOLDEN=1` rewrites the files that differ instead (then review
`git diff tests/golden`); any other non-empty value is an error, so `=0` or `=false`
cannot rewrite them by accident.

READERS declares, per test, the golden files it reads. It is checked three ways, each in
one process (so it holds under xdist): `check_golden` refuses a file not declared for the
running test; conftest fails a passing test that did not read every file declared for it;
and tests/test_golden.py checks that the directory holds exactly the declared files and
that every declared test exists.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"
UPDATE_VARIABLE = "COMMFX_UPDATE_GOLDEN"
MAX_DIFF_LINES = 200

ALL_STAGES = ("lifted", "distributed", "forward", "backward")
LOWERED_STAGES = ("distributed", "forward", "backward")


def names(prefix: str, stages: tuple[str, ...]) -> tuple[str, ...]:
    """Golden names (file names without .txt) of `prefix` at each stage."""
    return tuple(f"{prefix}.{stage}" for stage in stages)


# "<test file>::<test name, with its parameter id>" -> the goldens it reads.
READERS: dict[str, tuple[str, ...]] = {
    "test_golden.py::test_golden_graphs[gpt-moe]": names("gpt-moe.ep4", ALL_STAGES),
    "test_golden.py::test_golden_graphs[gpt-moe-tiny]": names("gpt-moe-tiny.ep4", ALL_STAGES),
    "test_golden.py::test_golden_partitioned_graphs": names("gpt-moe-tiny.ep4.lina-k2", LOWERED_STAGES),
    "test_golden.py::test_golden_packed_graphs": names("gpt-moe-tiny.ep4.packed", LOWERED_STAGES),
    "test_golden.py::test_golden_packed_and_chunked_graphs": names("gpt-moe-tiny.ep4.packed-k2", LOWERED_STAGES),
    "test_microbatch_overlap.py::test_golden_interleaved_graphs": names("gpt-moe-tiny.ep4.packed-k2-mb2", LOWERED_STAGES),
    "test_embedding_comm.py::test_golden_embedding_graphs[sparse]": names("gpt-moe-tiny.ep2.embedding-sparse", LOWERED_STAGES),
    "test_embedding_comm.py::test_golden_embedding_graphs[shard]": names("gpt-moe-tiny.ep2.embedding-shard", LOWERED_STAGES),
    "test_vocab_parallel_head.py::test_golden_vocab_parallel_head_graphs": names("embedding-lm-loss.ep2.head-shard", LOWERED_STAGES),
    "test_locality_gate.py::test_golden_locality_gate_graph": ("gpt-moe-tiny.ep4.2x2.locality_gate.distributed",),
    "test_locality_gate.py::test_capacity_mode_graph_measures_the_floor_and_dump_shows_both_factors": (
        "gpt-moe-tiny.ep4.2x2.locality_gate.capacity.distributed",
    ),
    "test_pipeline.py::test_golden_stages_and_boundaries": ("gpt-moe.pp2.stages",),
    "test_pipeline_tp.py::test_stages_carry_their_blocks_tp_collectives_on_the_tp_group": ("gpt-moe-tiny-2l.pp2.tp2.stages",),
}


def usage_error(value: str) -> str | None:
    """Why `COMMFX_UPDATE_GOLDEN=value` is not allowed, or None when it is (unset, empty or 1)."""
    if value in ("", "1"):
        return None
    return f"{UPDATE_VARIABLE}={value!r}: the only allowed value is 1 (rewrite the golden files); unset it to compare with them"


def updating() -> bool:
    """Whether this run rewrites goldens (COMMFX_UPDATE_GOLDEN=1); any other non-empty value fails."""
    value = os.environ.get(UPDATE_VARIABLE, "")
    error = usage_error(value)
    if error:
        pytest.fail(error, pytrace=False)
    return value == "1"


# The running test's id and the goldens it has read (set by conftest around every test).
_current: dict = {"test": None, "read": set()}


def begin_test(test_id: str) -> None:
    _current["test"], _current["read"] = test_id, set()


def end_test() -> tuple[str | None, set[str]]:
    """(test id, goldens it read), and forget them."""
    finished = (_current["test"], _current["read"])
    _current["test"], _current["read"] = None, set()
    return finished


def unread(test_id: str, read: set[str]) -> list[str]:
    """Goldens declared for `test_id` that it did not read."""
    return [name for name in READERS.get(test_id, ()) if name not in read]


def check_golden(name: str, text: str) -> None:
    """`text` equals tests/golden/<name>.txt, or fails with a unified diff (committed -> now).
    Under COMMFX_UPDATE_GOLDEN=1 a differing or missing file is rewritten instead."""
    test_id = _current["test"]
    if test_id is None:
        pytest.fail(f"golden {name!r} read outside a test (tests/conftest.py tracks the running test)", pytrace=False)
    if name not in READERS.get(test_id, ()):
        pytest.fail(
            f"{test_id} reads golden {name!r}, which READERS in tests/golden_files.py does not declare for it; "
            f"add it there (declared for this test: {list(READERS.get(test_id, ()))})",
            pytrace=False,
        )
    _current["read"].add(name)
    path = GOLDEN / f"{name}.txt"
    committed = path.read_text() if path.exists() else None
    if updating():
        if committed != text:
            path.write_text(text)
        return
    if committed is None:
        pytest.fail(f"tests/golden/{path.name} does not exist; create it with {UPDATE_VARIABLE}=1 and review it", pytrace=False)
    if committed != text:
        diff = list(
            difflib.unified_diff(
                committed.splitlines(), text.splitlines(), f"tests/golden/{path.name}", f"{name} (rendered now)", lineterm=""
            )
        )
        if not diff:
            diff = ["(the lines are equal: the files differ in line endings or the final newline)"]
        shown = diff[:MAX_DIFF_LINES] + ([f"... {len(diff) - MAX_DIFF_LINES} more diff lines"] if len(diff) > MAX_DIFF_LINES else [])
        pytest.fail(
            f"tests/golden/{path.name} differs from the rendered graph:\n"
            + "\n".join(shown)
            + f"\nIf the change is intended, rerun this test with {UPDATE_VARIABLE}=1 and review `git diff tests/golden`.",
            pytrace=False,
        )
