"""Embedding-row kernels (coalesce_rows, accumulate_rows): torch references against plain
loops, and the Triton kernels on CPU under TRITON_INTERPRET=1 against the references.

TRITON_INTERPRET must be set before triton is imported, so the Triton checks run in one
subprocess (this file run as a script) and each case is reported back as its own test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commfx.kernels import embedding as E

SRC_DIR = Path(E.__file__).resolve().parents[2]
HYP = settings(max_examples=25, deadline=None, database=None)


def loop_coalesce(ids, rows, padding_idx=-1):
    found: dict[int, torch.Tensor] = {}
    for i, key in enumerate(ids.tolist()):
        if key != padding_idx:
            found[key] = found[key] + rows[i] if key in found else rows[i].clone()
    keys = sorted(found)
    summed = torch.stack([found[k] for k in keys]) if keys else rows.new_zeros((0, rows.shape[1]))
    return torch.tensor(keys, dtype=torch.int64), summed


@HYP
@given(
    n=st.integers(0, 40), vocab=st.integers(1, 12), h=st.integers(1, 5), padding=st.integers(-1, 3), seed=st.integers(0, 1000)
)
def test_coalesce_reference_matches_a_loop(n, vocab, h, padding, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    rows = torch.randn(n, h, generator=g, dtype=torch.float64)
    unique, summed = E.coalesce_rows_reference(ids, rows, padding)
    want_ids, want_rows = loop_coalesce(ids, rows, padding)
    assert torch.equal(unique, want_ids)
    torch.testing.assert_close(summed, want_rows, rtol=0, atol=1e-12)


@HYP
@given(n=st.integers(0, 40), vocab=st.integers(1, 12), h=st.integers(1, 5), seed=st.integers(0, 1000))
def test_accumulate_reference_matches_index_put_with_accumulation(n, vocab, h, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    rows = torch.randn(n, h, generator=g, dtype=torch.float64)
    table = torch.randn(vocab, h, generator=g, dtype=torch.float64)
    want = table.clone().index_put_((ids,), rows, accumulate=True)
    got = E.accumulate_rows_reference(table.clone(), ids, rows)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_coalesce_then_accumulate_is_the_dense_embedding_gradient():
    ids = torch.tensor([[3, 1, 3], [0, 3, 1]])
    grad = torch.randn(2, 3, 4, dtype=torch.float64)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.embedding(ids, weight).backward(grad)
    unique, summed = E.coalesce_rows(ids.reshape(-1), grad.reshape(-1, 4))
    dense = E.accumulate_rows(torch.zeros(5, 4, dtype=torch.float64), unique, summed)
    torch.testing.assert_close(dense, weight.grad, rtol=0, atol=1e-14)


def test_references_reject_bad_arguments():
    with pytest.raises(TypeError, match="1-d int32/int64"):
        E.coalesce_rows_reference(torch.zeros(3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"rows must be \[len\(ids\), H\]"):
        E.coalesce_rows_reference(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 2))
    with pytest.raises(IndexError, match=r"row ids must lie in \[0, 4\)"):
        E.accumulate_rows_reference(torch.zeros(4, 2), torch.tensor([4]), torch.zeros(1, 2))


# ------------------------------------------------ Triton under the interpreter (subprocess)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(n, vocab, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g), torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)


def _case_coalesce(dtype, n, vocab, h, padding):
    def run():
        ids, rows = _inputs(n, vocab, h, dtype, n + h)
        unique, summed = E.coalesce_rows_triton(ids, rows, padding)
        want_ids, want_rows = E.coalesce_rows_reference(ids, rows, padding)
        assert torch.equal(unique, want_ids) and summed.dtype == dtype
        torch.testing.assert_close(summed, want_rows, **TOL[dtype])
    return run


def _case_accumulate(dtype, n, vocab, h):
    def run():
        ids, rows = _inputs(n, vocab, h, dtype, n * h)
        table = torch.randn(vocab, h, dtype=torch.float64).to(dtype)
        got = E.accumulate_rows_triton(table.clone(), ids, rows)
        torch.testing.assert_close(got, E.accumulate_rows_reference(table.clone(), ids, rows), **TOL[dtype])
    return run


INTERP_CASES = {
    **{f"coalesce-{str(d).removeprefix('torch.')}-n{n}-h{h}-pad{p}": _case_coalesce(d, n, 9, h, p)
       for d in (torch.float32, torch.float16) for n, h, p in ((40, 5, -1), (40, 300, 2), (0, 4, -1), (1, 1, 0))},
    **{f"accumulate-{str(d).removeprefix('torch.')}-n{n}-h{h}": _case_accumulate(d, n, 7, h)
       for d in (torch.float32, torch.float16) for n, h in ((30, 6), (50, 260), (0, 3))},
}


@pytest.fixture(scope="module")
def interpreter_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SRC_DIR)}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=240, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("case", sorted(INTERP_CASES))
def test_triton_kernel_interpreter(interpreter_results, case):
    assert interpreter_results.get("_interpret") is True, "subprocess did not run in interpreter mode"
    assert interpreter_results[case] is None, interpreter_results[case]


if __name__ == "__main__":
    from triton.runtime.interpreter import InterpretedFunction

    torch.set_num_threads(1)
    results = {"_interpret": isinstance(E._segment_sum_kernel, InterpretedFunction)}
    for name, case in INTERP_CASES.items():
        try:
            case()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
    print("RESULTS " + json.dumps(results))
