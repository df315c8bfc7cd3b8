"""`commfx bench --slow-rank R:FACTOR` (commfx.bench.straggler, the executor's per-op delays).

What is asserted is what cannot flake on a shared machine: argument errors, that per-op
delays sleep what the work owes, that a CPU-quota cgroup caps a busy process (where one
can be made), and that in a tiny 2-rank run the slow rank's own compute timer reads far
more than the other's (factor 5) and resize_tp's controller names it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commfx.bench import straggler
from commfx.bench.config import build_config
from commfx.bench.straggler import RankSlowdown, cgroup_problem, check_request, parse_slow_rank, prepare
from commfx.runtime.executor import SLEEP_SLICE_S, pay_delay, stretch
from bench_driver import DRIVER

ROOT = Path(__file__).resolve().parents[1]


def _parser():
    from commfx.cli.bench import add_parser

    parser = argparse.ArgumentParser(prog="commfx")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_parse_slow_rank():
    assert parse_slow_rank("1:2") == (1, 2.0)
    assert parse_slow_rank("0:1.5") == (0, 1.5)
    for bad in ("1", "1:", ":2", "a:2", "1:x", "-1:2", "1:1", "1:0.5", "1:1000"):
        with pytest.raises(ValueError, match="RANK:FACTOR"):
            parse_slow_rank(bad)


def test_cli_rejects_a_bad_slow_rank_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["bench", "gpt-moe-tiny", "--slow-rank", "1:0.5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--slow-rank" in err and "'1:0.5'" in err and "e.g. --slow-rank 1:2" in err
    args = _parser().parse_args(["bench", "gpt-moe-tiny", "--tp", "2", "--slow-rank", "1:2", "--healthy", "baseline"])
    assert (args.slow_rank, args.tp, args.healthy, args.slow_method) == ((1, 2.0), 2, ["baseline"], "auto")


def test_requests_that_do_not_fit_the_cluster_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"names rank 2, but the cluster has 2 ranks \(0..1\)"):
        check_request(2, 2.0, 2)
    with pytest.raises(ValueError, match="--slow-method must be one of"):
        check_request(0, 2.0, 2, "quota")
    monkeypatch.setattr(straggler, "cgroup_problem", lambda: "not root (cgroups need root)")
    with pytest.raises(ValueError, match="not root.*use --slow-method delay"):
        check_request(1, 2.0, 2, "cgroup")
    slow = prepare(1, 2.0, 2, "auto")  # auto falls back to delays and says why
    assert slow.method == "delay" and "not root" in slow.describe() and "per-op delays" in slow.describe()
    kwargs = dict(nodes=2, ranks_per_node=1, tp=2)
    with pytest.raises(ValueError, match="names rank 5"):
        build_config("gpt-moe-tiny", "lift,tensor_parallel", None, slow_rank=(5, 2.0), **kwargs)
    with pytest.raises(ValueError, match="--healthy nominal: no plan has that label"):
        build_config("gpt-moe-tiny", "lift,tensor_parallel", None, slow_rank=(1, 2.0), healthy=("nominal",), **kwargs)
    with pytest.raises(ValueError, match="needs --slow-rank"):
        build_config("gpt-moe-tiny", "lift,tensor_parallel", "lift,tensor_parallel", healthy=("baseline",), **kwargs)


class _Scheduler:
    slowdown = 3.0
    slow_debt_s = 0.0


def test_per_op_delays_sleep_what_the_work_owes():
    scheduler = _Scheduler()
    start = time.perf_counter()
    for _ in range(20):  # 20 nodes of 0.4 ms at factor 3: 16 ms owed, paid in slices of >= 1 ms
        stretch(scheduler, 0.4e-3)
    pay_delay(scheduler)
    slept = time.perf_counter() - start
    assert slept >= 16e-3 - 1e-6 and scheduler.slow_debt_s <= 0  # oversleeping is carried as credit
    assert SLEEP_SLICE_S <= 2e-3


def test_delay_slowdown_applies_only_to_the_slow_rank_and_slowed_plans():
    slow = prepare(1, 4.0, 2, "delay")
    assert slow.method == "delay" and not slow.note
    fast, slowed = _Scheduler(), _Scheduler()
    fast.slowdown = slowed.slowdown = 1.0
    with RankSlowdown(slow, 0).applied(fast):
        assert fast.slowdown == 1.0
    with RankSlowdown(slow, 1).applied(slowed, active=False):
        assert slowed.slowdown == 1.0
    with RankSlowdown(slow, 1).applied(slowed):
        assert slowed.slowdown == 4.0
    assert slowed.slowdown == 1.0 and slowed.slow_debt_s == 0.0


@pytest.mark.skipif(bool(cgroup_problem()), reason=f"no CPU-quota cgroup here: {cgroup_problem()}")
def test_cgroup_quota_caps_a_busy_process():
    slow = prepare(0, 4.0, 1, "cgroup")
    try:
        assert slow.method == "cgroup" and "CPU quota of 0.25 core" in slow.describe()
        code = (
            "import importlib.util, sys, time\n"
            "from pathlib import Path\n"
            f"spec = importlib.util.spec_from_file_location('straggler', {straggler.__file__!r})\n"  # not the package: no torch
            "module = sys.modules['straggler'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "RankSlowdown, SlowRank = module.RankSlowdown, module.SlowRank\n"
            f"slowdown = RankSlowdown(SlowRank(0, 4.0, 'cgroup', {slow.cgroup!r}), 0)\n"
            "with slowdown.applied(None):\n"
            "    wall, cpu = time.perf_counter(), time.process_time()\n"
            "    while time.perf_counter() - wall < 0.6: pass\n"
            "    print(time.process_time() - cpu, time.perf_counter() - wall)\n"
            "print(Path('/proc/self/cgroup').read_text())\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True).stdout
        cpu, wall = map(float, out.splitlines()[0].split())
        assert cpu < 0.5 * wall, f"a 0.25-core quota let a busy loop use {cpu:.2f}s of CPU in {wall:.2f}s"
        assert Path(slow.cgroup).name not in out.split("\n", 1)[1]  # it left the cgroup after the block
    finally:
        straggler.cleanup(slow)
    assert not Path(slow.cgroup).exists()


@pytest.mark.distributed
def test_tiny_run_the_slow_rank_computes_slower_and_semi_names_it(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-c", DRIVER, "bench", "gpt-moe-tiny", "--tp", "2",
            "--passes", "lift,tensor_parallel,resize_tp:window=2", "--nodes", "2", "--ranks-per-node", "1",
            "--no-emulation", "--steps", "4", "--warmup", "1", "--slow-rank", "1:5", "--slow-method", "delay",
            "--timeout", "150", "--json", str(out)]
    env = {**os.environ, "COLUMNS": "160", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "straggler: rank 1 computes 5x slower, by per-op delays" in proc.stdout
    result = json.loads(out.read_text())
    assert result["straggler"]["method"] == "delay" and result["straggler"]["rank"] == 1
    (plan,) = result["plans"]
    fast, slow = plan["rank_compute_only_median_s"]
    assert slow > 1.5 * fast, f"rank 1 should compute ~5x slower by its own timer: {fast * 1e3:.1f} vs {slow * 1e3:.1f} ms"
    assert plan["straggler_slowed"] and plan["resize_tp_decisions"], "resize_tp should have acted on the straggler"
    # a window where the shared machine stalls rank 0 may name it once; rank 1 is named
    assert any("(rank 1," in line for line in plan["resize_tp_decisions"]), plan["resize_tp_decisions"]


def test_a_rank_that_cannot_see_the_cgroup_says_what_to_do_instead():
    # `ip netns exec` remounts /sys: a rank reaches the cgroup through the parent's root
    assert straggler._visible(Path("/proc/self"), os.getpid()) == Path("/proc/self")
    with pytest.raises(RuntimeError, match="use --slow-method delay"):
        straggler._visible(Path("/sys/fs/cgroup/cpu/commfx-no-such-group"), os.getpid())
