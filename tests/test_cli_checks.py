"""What a new user's mistakes and edge cases give at the command line: never a silent pass,
one clear error (before ranks start where it can be known then), or a working run.

Model files are tests/model_files/user_models.py; each CLI call that spawns ranks is marked
distributed and kept to world 2, a tiny model and few steps."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from commfx.cli.main import main

MODELS = Path(__file__).parent / "model_files" / "user_models.py"


def model(function: str) -> str:
    return f"{MODELS}:{function}"


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to spawn ranks."""
    import commfx.runtime.launcher as launcher

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were spawned for an error that was known before")

    monkeypatch.setattr(launcher, "launch", refuse)


def one_error(capsys, argv: list[str], code: int = 2) -> str:
    """Run the CLI, expect `code` and exactly one `error:` line without a traceback; return the output."""
    assert main(argv) == code
    out = capsys.readouterr().out
    assert out.count("error:") == 1 and "Traceback" not in out, out
    return out.replace("\n", " ")


# ---------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("command", ["verify", "run"])
def test_nan_in_the_inputs_is_refused_before_ranks_start(capsys, no_launch, command):
    out = one_error(capsys, [command, model("nan_features"), "--world-size", "2"])
    assert "input features holds NaN (first at [2, 3, 5]; 1 of 512 values)" in out, out


@pytest.mark.parametrize("command", ["verify", "run"])
def test_nan_in_the_weights_is_refused_before_ranks_start(capsys, no_launch, command):
    out = one_error(capsys, [command, model("nan_weights"), "--world-size", "2"])
    assert "parameter lm_head.weight holds NaN (first at [3, 1]; 1 of 512 values)" in out, out


def test_a_nan_difference_is_never_a_pass():
    from commfx.verify import VerifyReport

    report = VerifyReport(None, output_diff=math.nan, grad_diffs={"w": 0.0}, replica_diff=0.0, tolerance=1e-10)
    assert not report.ok and report.failures == ["outputs"] and math.isnan(report.max_diff)
    report = VerifyReport(None, output_diff=0.0, grad_diffs={"w": math.nan, "v": 1.0}, replica_diff=math.nan, tolerance=1e-10)
    assert report.failures == ["w", "v", "replicated grads across ranks"] and math.isnan(report.max_diff)


@pytest.mark.distributed
def test_verify_fails_on_nan_in_the_distributed_run_naming_the_rank(capsys):
    """Rank 1's outputs are NaN; the reference's are not: FAIL (exit 1), rank 1's output named."""
    assert main(["verify", model("nan_on_rank1"), "--world-size", "2"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAIL: not finite: output 0 on rank 1 (nan)"), last


@pytest.mark.distributed
def test_run_stops_at_the_first_non_finite_loss_naming_the_rank(capsys):
    """exp() of rank 1's rows overflows: the run stops at step 1 naming rank 1's loss (rank 0's
    gradients, all-reduced with rank 1's NaN, come after it) instead of ending 'loss nan -> nan'."""
    out = one_error(capsys, ["run", model("overflows_on_rank1"), "--world-size", "2", "--steps", "2", "--passes", "lift,expert_parallel"])
    assert "step 1: the loss on rank 1 is not finite (nan)" in out, out
    assert "done in" not in out


def test_verify_refuses_a_non_finite_reference_before_ranks_start(capsys, no_launch):
    """The model as given overflows on the whole batch: the reference itself is not finite, so
    there is nothing to verify against; said before any rank starts."""
    out = one_error(capsys, ["verify", model("overflows_on_rank1"), "--world-size", "2"])
    assert "the single-process reference is not finite: output 0 (nan)" in out, out


# ---------------------------------------------------------------- verify's report and its FAIL path


@pytest.mark.distributed
def test_verify_fails_with_exit_1_when_the_distributed_run_is_wrong(capsys):
    """Rank 1 adds one to its outputs: FAIL on the outputs, exit 1. The batch is 4 sequences of
    8 float feature rows: 2 sequences and 16 tokens per rank (not 256 elements)."""
    assert main(["verify", model("adds_rank"), "--world-size", "2"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("FAIL: largest difference 1.000e+00 (tolerance 1e-10); over tolerance: outputs"), lines[-1]
    assert any(line.startswith("sequences per rank: [2, 2]; tokens per rank: [16, 16]") for line in lines), lines


# ---------------------------------------------------------------- the README's dict inputs, a rank without rows


@pytest.mark.distributed
def test_verify_and_run_take_dict_inputs(capsys, tmp_path):
    """{"input_ids": ids}: every tensor is split along dim 0 over the ranks, keys kept."""
    assert main(["verify", model("keywords"), "--world-size", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASS")
    history = tmp_path / "run.json"
    assert main(["run", model("keywords"), "--world-size", "2", "--steps", "2", "--json", str(history)]) == 0
    losses = [record["loss"] for record in json.loads(history.read_text())["history"]]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses


@pytest.mark.distributed
def test_verify_passes_and_says_so_when_a_rank_has_no_rows(capsys):
    """One sequence on two ranks: rank 1 has none, takes part on a stand-in row, and verify
    compares (it used to die in max() over rank 1's empty outputs)."""
    assert main(["verify", model("one_row"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "sequences per rank: [1, 0]; tokens per rank: [16, 0]" in out
    assert "rank 1 had no rows" in out.replace("\n", " ")
    assert out.strip().splitlines()[-1].startswith("PASS")


# ---------------------------------------------------------------- inputs against the forward, the model's own exceptions


@pytest.mark.parametrize(
    "function, message",
    [
        ("hf_typo", "input 'input_idz' is not a parameter of MixtralForCausalLM.forward (did you mean 'input_ids'?); "
                    "it takes input_ids, attention_mask, position_ids,"),
        ("hf_label", "input 'label' is not a parameter of MixtralForCausalLM.forward (did you mean 'labels'?)"),
        ("float_ids", "input input_ids is torch.float32 but holds token ids, which index an embedding: pass an integer "
                      "tensor (torch.long, e.g. input_ids.long())"),
    ],
)
def test_inputs_that_do_not_fit_the_forward_are_named_before_capture(capsys, no_launch, function, message):
    """They used to surface as a graph break with advice about control flow, or as 'expected 2
    tensor inputs in the graph, found 1'."""
    out = one_error(capsys, ["run", model(function), "--world-size", "2"])
    assert message in out and "graph break" not in out, out


def test_a_forward_that_raises_shows_its_own_exception(capsys, no_launch):
    out = one_error(capsys, ["verify", model("raises"), "--world-size", "2"])
    assert f"Raises.forward raised ValueError: forward is not written yet (at {MODELS}:" in out, out
    assert "graph break" not in out


@pytest.mark.distributed
def test_a_forward_that_raises_on_one_rank_shows_its_own_exception(capsys):
    out = one_error(capsys, ["run", model("raises_on_rank1"), "--world-size", "2", "--steps", "1"])
    assert out.startswith("training") and "error: rank 1 failed (its code raised)" in out, out
    assert "RaisesOnRank1.forward raised ValueError: rank 1's shard of the data is corrupt" in out and "graph break" not in out, out


def test_pp_on_blocks_not_in_a_module_list_says_what_was_expected_and_found(capsys, no_launch):
    """The blocks are attributes `first` and `second`: the error names the layout pipeline_split
    deals out and the model's own repeated modules (it said 'NamedBlocks has 0 layer(s)')."""
    out = one_error(capsys, ["dump", model("named_blocks"), "--world-size", "2", "--pp", "2", "--passes", "lift,pipeline_split"])
    assert "an nn.ModuleList of blocks named like layers.0, layers.1 (or model.layers.<i>)" in out, out
    assert "NamedBlocks has none; its repeated modules are first, second (DecoderLayer)" in out, out


def test_the_empty_example_error_says_what_the_code_does():
    """Capture needs an example row; a rank without rows at run time is fine (distribute and the
    CLI capture on a stand-in row), so the message no longer says every rank needs one."""
    from commfx.compiler.capture import CaptureError, capture
    from commfx.models import load_model

    tiny, (ids,) = load_model("gpt-moe-tiny", batch=1)
    with pytest.raises(CaptureError) as info:
        capture(tiny, (ids[:0],))
    message = str(info.value)
    assert message.startswith("capture traces the forward on the example inputs, which have no rows (input 0)"), message
    assert "A rank may have no rows at run time" in message and "Every rank needs" not in message, message
