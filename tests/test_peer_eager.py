"""`peer:eager` and `peer:compile` (issue 42): the plain model in one process, called eagerly and
through torch.compile, each checked equal to the single-process model by the bench before it is
timed, then timed in the same rounds as a commfx plan at world 1, with the plan's per-round wall
ratio to each; a larger world or an unknown compile mode is refused before any rank starts."""

import json
import re
import statistics

import pytest

from commfx.cli.main import main

pytestmark = pytest.mark.distributed


def test_bench_times_the_eager_and_compiled_model_beside_a_plan_at_world_1(tmp_path, capsys):
    out = tmp_path / "world1.json"
    argv = ["bench", "gpt-moe-tiny", "--passes", "lift,expert_parallel", "--vs", "peer:eager", "--also", "compile=peer:compile",
            "--nodes", "1", "--ranks-per-node", "1", "--no-emulation", "--steps", "3", "--warmup", "1", "--batch", "4",
            "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().out
    stdout = " ".join(capsys.readouterr().out.split())  # the console wraps lines
    result = json.loads(out.read_text())
    plans = {p["label"]: p for p in result["plans"]}
    assert plans["baseline"]["peer_check"].startswith("eager: equal to the single-process model")
    assert plans["compile"]["peer_check"].startswith("compile: equal to the single-process model")
    for label in ("baseline", "compile"):  # one process: nothing communicated
        assert plans[label]["bytes_per_step"] == {} and plans[label]["peer_payload_bytes_per_step"] is None
    # Compiling happened before timing: it took longer than any timed step of the compiled model.
    [note] = [line for line in plans["compile"]["choices"] if line.startswith("torch.compile(model")]
    assert "1 experts modules run eagerly (experts=eager)" in note  # gpt-moe-tiny's one MoE layer: dynamo traces the rest
    compile_s = float(re.search(r"took ([0-9.]+) s", note).group(1))
    assert max(plans["compile"]["wall"]["samples_s"]) < compile_s, note
    # The plan's wall over each peer's, round by round, summarised by the median of those ratios.
    walls = {label: p["wall"]["samples_s"] for label, p in plans.items()}
    ratios = result["paired_wall_ratios"]
    assert set(ratios) == {"baseline", "compile"}
    for label, ratio in ratios.items():
        per_round = [a / b for a, b in zip(walls["plan"], walls[label], strict=True)]
        assert ratio["samples_s"] == pytest.approx(per_round) and ratio["median_s"] == pytest.approx(statistics.median(per_round))
        line = f"paired wall ratio plan ÷ {label} ({plans[label]['passes']}; same round, interleaved): median {ratio['median_s']:.2f},"
        assert line in stdout, stdout
    assert result["paired_wall_ratio"]["median_s"] == pytest.approx(ratios["baseline"]["median_s"])


@pytest.mark.parametrize(
    "vs, ranks, message",
    [("peer:eager", 2, "peer:eager is the plain model in one process"),
     ("peer:compile", 2, "world of 2 ranks. There the plain model on each rank's share with gradients all-reduced is peer:ddp"),
     ("peer:compile:mode=fastest", 1, "torch.compile has no mode 'fastest'")],
)
def test_refusals_come_before_any_rank(vs, ranks, message, capsys):
    argv = ["bench", "gpt-moe-tiny", "--passes", "lift", "--nodes", "1", "--ranks-per-node", str(ranks), "--no-emulation",
            "--vs", vs]
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().out.split())


def test_the_check_keeps_a_prefix_of_token_ids_and_any_other_batch_whole():
    import torch

    from commfx.bench.peers.eager import CHECK_TOKENS, first_tokens

    ids, mask = torch.randint(0, 9, (2, CHECK_TOKENS + 5)), torch.ones(2, CHECK_TOKENS + 5, dtype=torch.long)
    cut = first_tokens({"input_ids": ids, "attention_mask": mask})
    assert torch.equal(cut["input_ids"], ids[:, :CHECK_TOKENS]) and cut["attention_mask"].shape == (2, CHECK_TOKENS)
    features = (torch.randn(2, CHECK_TOKENS + 5),)
    assert first_tokens(features)[0] is features[0]
