"""The README's recipes, run as written: examples/ on 2 gloo ranks, a few steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(argv: list[str], timeout: float = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def torchrun(script: str, *args: str) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLES / script), *args])


def losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", text)]


@pytest.mark.distributed
def test_torchrun_training_script_on_a_raw_hf_moe_model(tmp_path):
    """Its first loss is the single-process model's on the same rows (the mean of each
    rank's HF loss), and training lowers it."""
    import importlib.util

    import torch

    report = tmp_path / "report.json"
    out = torchrun("train_hf_moe.py", "--steps", "3", "--report", str(report))
    values = losses(out)
    assert len(values) == 3 and values[-1] < values[0], out
    spec = importlib.util.spec_from_file_location("train_hf_moe", EXAMPLES / "train_hf_moe.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.build_model()
    with torch.no_grad():
        expected = sum(model(input_ids=ids, labels=ids).loss.item() for ids in (next(example.batches(r, 2, 4, 32)) for r in range(2))) / 2
    first = json.loads(report.read_text())["losses"][0]
    assert abs(first - expected) <= 1e-5, (first, expected)


@pytest.mark.distributed
def test_torch_compile_script_with_the_commfx_backend():
    out = torchrun("compile_hf_moe.py", "--steps", "3")
    values = losses(out)
    assert len(values) == 3 and values[-1] < values[0], out


@pytest.mark.distributed
def test_model_file_for_the_cli_verifies_and_runs():
    commfx = [sys.executable, "-m", "commfx"]
    out = run([*commfx, "verify", "examples/hf_moe_model.py:build", "--world-size", "2"])
    assert "PASS" in out
    out = run([*commfx, "run", "examples/hf_moe_model.py:build", "--world-size", "2", "--steps", "2"])
    assert len(losses(out)) >= 2, out


def test_readme_python_blocks_are_quoted_from_the_examples():
    """Every line of a Python block in the README appears in the examples/ file the text
    just before it names, so the README shows code that the tests above run."""
    readme = (ROOT / "README.md").read_text()
    checked = 0
    for match in re.finditer(r"```python\n(.*?)```", readme, re.S):
        named = re.findall(r"examples/(\w+\.py)", readme[: match.start()])
        assert named, f"a Python block in the README names no examples/ file before it:\n{match.group(1)}"
        source = {line.strip() for line in (EXAMPLES / named[-1]).read_text().splitlines()}
        for line in filter(None, (l.strip() for l in match.group(1).splitlines())):
            assert line in source, f"README line not in examples/{named[-1]}: {line!r}"
            checked += 1
    assert checked >= 10


@pytest.mark.distributed
def test_torchrun_pipeline_script_with_compression():
    out = torchrun("train_pipeline.py", "--steps", "3", "--passes", "lift,pipeline_split:microbatches=4,compress_pipeline:rank=4")
    values = losses(out)
    assert len(values) == 3 and values[-1] < values[0], out
