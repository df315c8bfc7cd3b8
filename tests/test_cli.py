"""The command line: listing, dumping, verifying and clear errors with exit status 2."""

import pytest

from commfx.cli.main import main


def test_passes_lists_every_registered_pass(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "lift" in out and "expert_parallel" in out


@pytest.mark.parametrize("fmt, marker", [("code", "commfx.all_to_all("), ("tabular", "made by"), ("dot", "digraph commfx")])
def test_dump_formats(tmp_path, fmt, marker):
    out = tmp_path / "graph.txt"
    assert main(["dump", "gpt-moe-tiny", "--world-size", "2", "--format", fmt, "-o", str(out)]) == 0
    assert marker in out.read_text()


def test_dump_backward_stage_shows_backward_all_to_all(capsys):
    assert main(["dump", "gpt-moe-tiny", "--world-size", "2", "--stage", "backward"]) == 0
    out = capsys.readouterr().out
    assert "commfx.all_to_all_start(" in out and "commfx.wait_tensor(" in out


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_dump_shows_chunked_all_to_alls_with_their_priority(stage, capsys):
    passes = "lift,expert_parallel,partition_a2a:k=4"
    assert main(["dump", "gpt-moe-tiny", "--world-size", "2", "--stage", stage, "--passes", passes]) == 0
    starts = [line for line in capsys.readouterr().out.splitlines() if "commfx.all_to_all_start(" in line]
    suffix = " (bw)" if stage == "backward" else ""
    for role in ("dispatch", "combine"):
        for j in range(1, 5):
            assert any(f"'a2a', 'layers.0.moe.experts {role} {j}/4{suffix}')" in line for line in starts), (role, j)


def test_verify_from_the_command_line(capsys):
    assert main(["verify", "gpt-moe-tiny", "--world-size", "2", "--batch", "3"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dump", "gpt-moe", "--passes", "lift,warp"], "unknown pass 'warp'"),
        (["dump", "gpt-moe", "--world-size", "3"], "do not divide evenly over expert-parallel size 3"),
        (["dump", "no-such-model"], "unknown model 'no-such-model'"),
        (["dump", "hf:nope"], "nope"),
        (["dump", "gpt-moe", "--passes", "lift,expert_parallel,partition_a2a:k=0"], "partition_a2a k must be >= 1"),
        (["bench", "gpt-moe-tiny", "--also", "no-equals-sign"], "must be LABEL=PASSES"),
        (["bench", "gpt-moe-tiny", "--vs", "lift", "--also", "baseline=lift"], "labels must be distinct"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().out.replace("\n", " ")
