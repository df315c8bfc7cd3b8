"""What a new user's mistakes and edge cases give at the command line: never a silent pass,
one clear error (before ranks start where it can be known then), or a working run.

Model files are tests/model_files/user_models.py; each CLI call that spawns ranks is marked
distributed and kept to world 2, a tiny model and few steps."""

from __future__ import annotations

import json
import math
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


# ---------------------------------------------------------------- the command line itself


@pytest.mark.parametrize("option", ["--json", "--trace", "--dump"])
def test_an_unwritable_output_path_is_refused_before_ranks_start(capsys, no_launch, tmp_path, option):
    """The path's parent is a file, so no directory can be made there (this runs as root too,
    where permissions would not stop it); it used to fail after the whole run."""
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a directory")
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", option, str(blocker / "out.json")])
    assert f"{option} {blocker / 'out.json'}: cannot write there: {blocker} is a file, not a directory" in out, out


def test_a_missing_output_directory_is_made_before_ranks_start(tmp_path):
    """A parent directory that does not exist yet is created (it would be at the end anyway)."""
    from commfx.cli.checks import check_output_paths

    target = tmp_path / "new" / "deeper" / "run.json"
    check_output_paths({"--json": str(target)})
    assert target.parent.is_dir() and not target.exists()


@pytest.mark.parametrize("value", ["-1e-10", "-0.5", "-inf"])
def test_a_negative_number_reaches_its_check_and_is_refused(capsys, value):
    """argparse took `-1e-10` for an option ('expected one argument')."""
    with pytest.raises(SystemExit) as info:
        main(["verify", "gpt-moe-tiny", "--tolerance", value])
    assert info.value.code == 2
    assert f"argument --tolerance: must be a non-negative number, got {value}" in capsys.readouterr().err


def test_negative_numbers_still_parse_where_they_are_allowed():
    from commfx.cli.checks import numbers_as_values
    from commfx.cli.main import build_parser

    args = build_parser().parse_args(numbers_as_values(["run", "gpt-moe-tiny", "--seed", "-3", "--lr", "1e-3"]))
    assert args.seed == -3 and args.lr == 1e-3


@pytest.mark.parametrize(
    "argv, asked",
    [
        (["run", "gpt-moe-tiny", "--world-size", "1000", "--ep", "4"], "--world-size 1000"),
        (["verify", "gpt-moe-tiny", "--world-size", "1000"], "--world-size 1000"),
        (["bench", "gpt-moe-tiny", "--nodes", "10", "--ranks-per-node", "100"], "--nodes 10 x --ranks-per-node 100 = 1000"),
    ],
)
def test_a_local_world_larger_than_the_machine_is_refused(capsys, no_launch, argv, asked):
    from commfx.cli.checks import max_local_world

    cap = max_local_world()
    out = one_error(capsys, argv)
    assert f"{asked} would start 1000 processes on this machine; commfx starts at most {cap} locally" in out, out
    assert "torchrun" in out


def test_an_internal_error_ends_with_one_line_saying_it_is_a_commfx_defect(capsys, monkeypatch):
    """A bug in commfx (here: a KeyError from a command) is not a bare traceback: one error line
    where it happened, then one line with the versions and the command for the full traceback."""
    import commfx.cli.main as cli

    def fails(args):
        return {}["missing"]

    monkeypatch.setattr(cli, "cmd_passes", fails)
    monkeypatch.delenv("COMMFX_TRACEBACK", raising=False)
    assert main(["passes"]) == 3
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[0].startswith("error: internal error: KeyError: 'missing' (at ") and "in fails)" in lines[0], lines
    assert lines[-1].startswith("This is a commfx defect, not a mistake in the command: commfx 0.1.0, torch "), lines
    assert "transformers " in lines[-1] and lines[-1].endswith("Rerun as COMMFX_TRACEBACK=1 commfx passes for the full traceback, and report it."), lines
    assert "Traceback" not in captured.out + captured.err

    monkeypatch.setenv("COMMFX_TRACEBACK", "1")
    assert main(["passes"]) == 3
    captured = capsys.readouterr()
    assert "Traceback (most recent call last)" in captured.err and "KeyError: 'missing'" in captured.err
    assert "This is a commfx defect" in captured.out.strip().splitlines()[-1]


def test_known_user_errors_keep_their_one_message(capsys, no_launch):
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--passes", "lift,warp"])
    assert "unknown pass 'warp'" in out and "defect" not in out
