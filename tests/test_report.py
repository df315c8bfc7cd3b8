"""benchmarks/report.py: the committed results page is what the committed runs generate, and
its ratios are recomputed from the runs' samples (not copied from the JSON's summaries)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _report()


def test_committed_page_is_what_the_runs_generate():
    """`report.py --check` exits 0 only when RESULTS.md matches; it says where it differs."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
    page = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(page) <= report.MAX_LINES
    assert any(line.startswith("| row |") for line in page[:report.HEADLINE_BY_LINE])


def test_check_fails_with_a_diff_on_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "RESULTS.md"
    stale.write_text((ROOT / "benchmarks" / "RESULTS.md").read_text().replace("| row |", "| seed |", 1))
    monkeypatch.setattr(report, "PAGE", stale)
    assert report.main(["--check"]) == 1


def test_every_named_json_exists_and_every_bench_row_names_its_json():
    r = report.Report()
    page = r.render()
    for name in r.src.cache:
        assert (ROOT / "benchmarks" / name).is_file(), name
    for row in r.headline:
        assert row[-1].startswith("`") and all((ROOT / "benchmarks" / f.strip(" `")).is_file() for f in row[-1].split(","))
    assert page.count("\n| **") >= 8  # Lina, LocMoE, EmbRace, Optimus-CC, SEMI, ZeRO, GPU kernels, simulator


def test_paired_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians():
    """The Lina run's naive plan: per-round ratios to the peer, recomputed from samples_s."""
    data = json.loads((ROOT / "benchmarks" / "peers_lina_gpt_moe_100mbit_2x1.json").read_text())
    plans = {p["label"]: p["wall"]["samples_s"] for p in data["plans"]}
    expected = statistics.median(a / b for a, b in zip(plans["naive"], plans["baseline"]))
    run = report.Run("peers_lina_gpt_moe_100mbit_2x1.json", data)
    assert run.paired("naive", "baseline")[0] == pytest.approx(expected)
    assert run.paired("naive", "baseline")[0] != pytest.approx(statistics.median(plans["naive"]) / statistics.median(plans["baseline"]), rel=1e-3)
    assert report.paired([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == (3.0, 2.5, 3.5)
    with pytest.raises(ValueError, match="same rounds"):
        report.paired([1.0, 2.0], [1.0])


def test_the_lossless_balance_bound_re_splits_only_the_compute_in_proportion_to_speed():
    """Healthy step 100 ms, 60 of it each rank's compute; one of two ranks at half speed: the
    compute re-split 2:1 takes 2 * 60 / 1.5 = 80 ms, the 40 ms of the rest stays: 1.2 of the step.
    Four ranks: 4 * 60 / 3.5."""
    def healthy(ranks: int, factor: float = 2.0) -> dict:
        plan = {"label": "healthy", "wall": {"samples_s": [0.1, 0.1, 0.1]}, "rank_compute_only_median_s": [0.06] * ranks}
        return {"plans": [plan], "straggler": {"factor": factor}}

    assert report.Run("two", healthy(2)).balance_bound("healthy") == pytest.approx(1.2)
    assert report.Run("four", healthy(4)).balance_bound("healthy") == pytest.approx((0.04 + 0.24 / 3.5) / 0.1)
    assert report.Run("same speed", healthy(2, 1.0)).balance_bound("healthy") == pytest.approx(1.0)


def test_template_may_not_state_figures():
    report.check_template("Prose about `run_bench.sh` and top-1 gating on Qwen3 {{lina}}")
    with pytest.raises(ValueError, match="figures of its own"):
        report.check_template("Lina is 1.76x faster {{lina}}")


def test_load_is_marked_above_the_per_core_threshold_and_not_invented():
    assert report.load_cell(None) == "not recorded"
    record = {"machine": {"cores": 2, "load_start": [3.5, 1, 1], "load_end": [1.0, 1, 1], "others_cpu_share": 0.4}}
    assert report.load_cell(record).startswith("**loaded**") and "40%" in report.load_cell(record)
    record["machine"]["load_start"] = [2.0, 1, 1]
    assert not report.load_cell(record).startswith("**loaded**")
    assert set(report.missing_fields({"plans": [], "run": None})) == {"commit", "command", "load", "proportions"}
