"""`commfx dump --diff PASS`: what one pass changed, as a unified diff of the rendered graph."""

from commfx.cli.main import main

MOE = ["dump", "gpt-moe-tiny", "--world-size", "2"]


def _diff(capsys, passes: str, name: str) -> tuple[list[str], list[str], str]:
    assert main([*MOE, "--passes", passes, "--diff", name]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"--- before {name}" and lines[1] == f"+++ after {name}"
    added = [line[1:] for line in lines[2:] if line.startswith("+")]
    removed = [line[1:] for line in lines[2:] if line.startswith("-")]
    return added, removed, out


def test_diff_partition_a2a_shows_the_chunked_exchange_replacing_the_single_one(capsys):
    added, removed, _ = _diff(capsys, "lift,expert_parallel,partition_a2a:k=2", "partition_a2a")
    assert any("commfx.split_chunks(" in line for line in added)
    assert any("commfx.merge_chunks(" in line for line in added)
    assert sum("commfx.all_to_all(" in line for line in added) == 4  # dispatch and combine, 2 chunks each
    single = [line for line in removed if "commfx.all_to_all(" in line]
    assert len(single) == 2 and all("[expert_parallel:" in line for line in single)  # the unchunked dispatch and combine
    # Nothing outside the MoE exchange changes: what goes is expert_parallel's, and the
    # combine that now reads the merged rows.
    assert all("[expert_parallel:" in line or "commfx.moe_combine(" in line for line in removed)
    assert not any("torch.nn.functional" in line or "embedding" in line for line in added + removed)


def test_diff_lift_shows_the_lifted_ops(capsys):
    added, removed, _ = _diff(capsys, "lift,expert_parallel", "lift")
    lifted = [line for line in added if "# [lift:" in line]
    assert any("commfx.embedding(" in line for line in lifted)
    assert any("commfx.moe_combine(" in line for line in lifted)
    assert not any("# [lift:" in line for line in removed)
    assert any("torch.nn.functional.embedding(" in line for line in removed)
    assert not any("[expert_parallel:" in line for line in added)  # the diff stops at lift


def test_diff_of_a_pass_not_in_the_plan_is_an_error_naming_the_plan(capsys):
    assert main([*MOE, "--passes", "lift,expert_parallel", "--diff", "partition_a2a"]) == 2
    out = capsys.readouterr().out
    assert "--diff partition_a2a" in out and "lift, expert_parallel" in out


def test_diff_writes_to_output(tmp_path):
    out = tmp_path / "lift.diff"
    assert main([*MOE, "--passes", "lift,expert_parallel", "--diff", "expert_parallel", "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("--- before expert_parallel\n+++ after expert_parallel\n")
    assert "+%all_to_all_default = commfx.all_to_all(" in text
