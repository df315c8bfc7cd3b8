"""Errors a user sees: once, before ranks are spawned where they can be known then, without
a traceback, printed literally; inside ranks, the rank whose own code raised is named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from commfx.cli.main import main
from commfx.plan import PlanError


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to spawn ranks."""
    import commfx.runtime.launcher as launcher

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were spawned for an error that was known before")

    monkeypatch.setattr(launcher, "launch", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "gpt-moe-tiny", "--steps", "-1"], "argument --steps: must be a positive integer, got -1"),
        (["run", "gpt-moe-tiny", "--steps", "many"], "argument --steps: must be a positive integer, got 'many'"),
        (["run", "gpt-moe-tiny", "--world-size", "0"], "argument --world-size: must be a positive integer, got 0"),
        (["verify", "gpt-moe-tiny", "--tolerance", "-1"], "argument --tolerance: must be a non-negative number"),
        (["bench", "gpt-moe-tiny", "--nodes", "0"], "argument --nodes: must be a positive integer, got 0"),
    ],
)
def test_numeric_arguments_are_validated(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        # An unsupported model: known from the plan and the model alone.
        (["run", "hf:gpt_oss", "--world-size", "2", "--steps", "1"], "GptOssForCausalLM has no MoE block commfx recognises"),
        (["verify", "hf:gpt_oss", "--world-size", "2"], "GptOssExperts"),
        # A batch that leaves a rank without rows.
        (["run", "gpt-moe-tiny", "--world-size", "2", "--batch", "1", "--steps", "1"], "1 rows for 2 ranks"),
        # A plan error.
        (["run", "gpt-moe-tiny", "--world-size", "2", "--passes", "lift,warp"], "unknown pass 'warp'"),
    ],
)
def test_errors_every_rank_would_hit_are_printed_once_before_launch(capsys, no_launch, argv, message):
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert message in out.replace("\n", " ")
    assert out.count("error:") == 1 and "Traceback" not in out


def test_error_text_is_printed_literally(capsys, monkeypatch):
    import commfx.cli.main as cli

    text = "gloo says [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed [red]x[/red]"

    def fails(args):
        raise PlanError(text)

    monkeypatch.setattr(cli, "cmd_passes", fails)
    assert main(["passes"]) == 2
    assert text in capsys.readouterr().out.replace("\n", "")


@pytest.mark.distributed
def test_the_rank_whose_code_raised_is_named_not_the_one_stopped_after_it():
    from commfx.runtime.launcher import LaunchError, launch

    sys.path.insert(0, str(Path(__file__).parent))
    with pytest.raises(LaunchError) as info:
        launch("dist_workers:raises_on_one_rank", 2, {"raising_rank": 1}, timeout_s=60, grace_s=5)
    message = str(info.value)
    assert message.startswith("rank 1 failed (its code raised)"), message
    assert "the model factory failed on rank 1" in message
    assert "--- rank 0 ---" not in message  # printed once: the root cause's error only
