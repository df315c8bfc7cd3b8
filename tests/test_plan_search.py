"""commfx plan (the search over plans by simulation): candidates ranked by predicted step, the
memory limit prunes, --emit writes a --passes string `commfx dump` takes, and bad input is one
clear error (single process)."""

from __future__ import annotations

import re

import pytest

from commfx.cli.main import main
from commfx.cli.plan import layout, parse_bytes
from commfx.plan import PlanError
from commfx.simulate import load_cluster
from commfx.simulate.search import Candidate, Facts, extensions, structures

CANDIDATES = ["lift,expert_parallel", "lift", "lift,expert_parallel,pack_experts:degree=2", "lift,expert_parallel,partition_a2a:k=2"]


def test_plan_ranks_by_step_prunes_by_memory_and_emits_what_dump_takes(tmp_path, capsys):
    """On gpt-moe-tiny at 2 x 1, 100 Mbit/s, replicated experts (`lift`) are fastest but hold
    the most; a limit below their bytes leaves the expert-parallel plans, best first."""
    emitted = tmp_path / "plan.txt"
    argv = ["plan", "gpt-moe-tiny", "--cluster", "emulated", "--world", "2", "--ranks-per-node", "1", "--inter-node", "100mbit",
            "--memory-limit", "140kB", "--emit", str(emitted)]
    assert main(argv + [a for p in CANDIDATES for a in ("--candidate", p)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"│ (\d) │ (\S+)\s+│\s+([\d.]+) ms", out)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    steps = [float(r[2]) for r in rows]
    assert steps == sorted(steps)
    assert "lift" not in [r[1] for r in rows] and "over the memory limit" in out and "--passes lift at 0.1491 MB" in out
    chosen = emitted.read_text().strip()
    assert chosen == rows[0][1] == "lift,expert_parallel,pack_experts:degree=2"
    assert main(["dump", "gpt-moe-tiny", "--passes", chosen, "-o", str(tmp_path / "g.txt")]) == 0
    assert "all_to_all" in (tmp_path / "g.txt").read_text()


def test_candidates_cover_the_modelled_options():
    moe = structures(Facts(num_experts=8, top_k=1, untied_tables=1), world=4)
    passes = {(c.passes, c.ep) for c in moe}
    assert ("lift", 0) in passes and ("lift,expert_parallel", 2) in passes
    assert {f"lift,expert_parallel,partition_a2a:k={k}" for k in ("1", "2", "4", "8", "auto")} <= {p for p, ep in passes if ep == 0}
    assert ("lift,expert_parallel,pack_experts:degree=4,partition_a2a:k=auto", 2) in passes
    cluster = load_cluster("a100")
    grown = [c.passes for d in ("locality", "embedding", "sharding") for c in extensions(moe[1], d, Facts(8, 1, 1), cluster)]
    assert "lift,locality_gate,expert_parallel" in grown and "lift,expert_parallel,split_embedding_comm" in grown
    assert "lift,expert_parallel,shard_states:stage=3" in grown
    assert [c.precision for c in extensions(moe[1], "precision", Facts(8, 1, 1), cluster)] == ["fp32", "bf16"]
    assert len(extensions(moe[1], "locality", Facts(8, 2, 0), cluster)) == 1  # top-2: no locality gate candidate


def test_model_parallel_dimensions_lay_out_tp_pp_and_compression():
    """tp inside a node, pp up to the layers with pp and 4 pp micro-batches, and a pipeline's
    compression rank, each inserted before the passes that come after model parallelism."""
    cluster = load_cluster("a100").with_layout(2)  # 16 ranks, 8 a node
    facts = Facts(num_experts=16, top_k=2, untied_tables=0, layers=4, batch_rows=256)
    sharded = Candidate("lift,expert_parallel,shard_states:stage=1")
    tensor = extensions(sharded, "tensor", facts, cluster)[1:]
    assert [(c.passes, c.tp) for c in tensor] == [("lift,expert_parallel,tensor_parallel,shard_states:stage=1", t) for t in (2, 4, 8)]
    piped = extensions(Candidate("lift,expert_parallel"), "pipeline", facts, cluster)[1:]
    assert {(c.pp, c.passes.rsplit(":", 1)[1]) for c in piped} == {(2, "microbatches=2"), (2, "microbatches=8"), (4, "microbatches=4"), (4, "microbatches=16")}
    assert extensions(piped[0], "pipeline", facts, cluster) == [piped[0]]  # one pipeline a plan
    squeezed = extensions(piped[0], "compression", facts, cluster)[1:]
    assert [c.passes for c in squeezed] == [f"{piped[0].passes},compress_pipeline:rank={r}" for r in (4, 16, 64)]
    assert squeezed[0].command_args().endswith("--pp 2") and extensions(Candidate("lift"), "compression", facts, cluster) == [Candidate("lift")]
    few_rows = extensions(Candidate("lift,expert_parallel"), "pipeline", Facts(16, 2, 0, layers=4, batch_rows=16), cluster)[1:]
    assert {(c.pp, c.passes.rsplit("=", 1)[1]) for c in few_rows} == {(2, "2"), (4, "4")}  # 2 and 4 rows a data-parallel rank


def test_the_search_ranks_pipelines_beside_expert_parallelism(capsys):
    """On 2 nodes x 1 rank at 100 Mbit/s the search simulates pipelines of gpt-moe (2 layers),
    compressed and not, and names the flags that run them."""
    assert main(["plan", "gpt-moe", "--cluster", "emulated", "--world", "2", "--ranks-per-node", "1", "--inter-node", "100mbit",
                 "--model-arg", "hidden_size=64", "--model-arg", "expert_hidden=64", "--top", "40"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"│\s+\d+ │ (\S+(?: --\S+ \S+)*)\s+│\s+([\d.]+) ms", out)
    plans = {plan for plan, _ in rows}
    assert "lift,pipeline_split:microbatches=2 --pp 2" in plans and "lift,expert_parallel" in plans
    assert any("compress_pipeline:rank=4" in p and p.endswith("--pp 2") for p in plans)
    steps = [float(step) for _, step in rows]
    assert steps == sorted(steps)


def test_bad_input_is_one_clear_error(capsys):
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("80e9") == 80e9 and parse_bytes("512MB") == 512e6
    with pytest.raises(PlanError, match="--memory-limit 'lots'"):
        parse_bytes("lots")
    h100 = load_cluster("h100")
    assert layout(h100, 4, None, None, None).world_size == 4 and layout(h100, 32, None, None, None).nodes == 4
    with pytest.raises(PlanError, match="--world 12 is not a multiple of 8 ranks per node"):
        layout(h100, 12, None, None, None)
    assert main(["plan", "gpt-moe-tiny", "--memory-limit", "-3"]) == 2
    assert "error: --memory-limit '-3'" in capsys.readouterr().out
    assert main(["plan", "gpt-moe-tiny", "--cluster", "h100", "--world", "6", "--nodes", "4"]) == 2
    assert "--world 6 is not a multiple of --nodes 4" in capsys.readouterr().out


def test_rows_per_rank_traces_one_row_and_predicts_the_full_batch():
    """--rows-per-rank (for models too large to trace at their batch): one traced sequence
    per rank scaled to N predicts what tracing N sequences does."""
    from commfx import Plan
    from commfx.simulate import simulate

    cluster = load_cluster("emulated").with_layout(2, 1, "100mbit")
    plan = Plan.from_cli("lift,expert_parallel,partition_a2a:k=2", world_size=2, ranks_per_node=1)
    full = simulate("gpt-moe-tiny", plan, cluster, batch=16).result
    scaled = simulate("gpt-moe-tiny", plan, cluster, rows_per_rank=8).result
    assert scaled.step_s == pytest.approx(full.step_s, rel=0.02)
    assert scaled.memory["total"] == pytest.approx(full.memory["total"], rel=0.05)
