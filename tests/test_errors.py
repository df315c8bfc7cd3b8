"""Errors a user sees: once, before ranks are spawned where they can be known then, without
a traceback, printed literally; inside ranks, the rank whose own code raised is named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from commfx.cli.main import main
from commfx.plan import PlanError


def launch_error(worker: str, **kwargs) -> str:
    """The LaunchError message of running tests/dist_workers.py:`worker` on 2 ranks."""
    from commfx.runtime.launcher import LaunchError, launch

    sys.path.insert(0, str(Path(__file__).parent))
    with pytest.raises(LaunchError) as info:
        launch(f"dist_workers:{worker}", 2, kwargs, timeout_s=120, grace_s=3)
    return str(info.value)


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
        (["bench", "gpt-moe-tiny", "--timeout", "-5"], "argument --timeout: must be a positive number, got -5"),
        (["run", "gpt-moe-tiny", "--collective-timeout", "inf"], "argument --collective-timeout: must be a positive number, got inf"),
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
        # A plan error.
        (["run", "gpt-moe-tiny", "--world-size", "2", "--passes", "lift,warp"], "unknown pass 'warp'"),
        # Only the last rank's share (1 of 3 sequences) is too small: the preflight compiles the smallest share.
        (["verify", "gpt-moe", "--world-size", "2", "--batch", "3", "--passes", "lift,expert_parallel,microbatch_overlap"],
         "this rank's batch is 1 sequence"),
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


def test_paths_and_pass_lists_are_printed_literally(capsys, tmp_path):
    """`[run1]` in a path is not a rich style tag (it used to vanish: 'out//graph.txt')."""
    output = tmp_path / "[run1]" / "graph.txt"
    output.parent.mkdir()
    assert main(["dump", "gpt-moe-tiny", "--world-size", "2", "-o", str(output)]) == 0
    assert f"to {output}" in capsys.readouterr().out.replace("\n", "")
    assert output.exists()


@pytest.mark.distributed
def test_the_rank_whose_code_raised_is_named_not_the_one_stopped_after_it():
    message = launch_error("raises_on_one_rank", raising_rank=1)
    assert message.startswith("rank 1 failed (its code raised)"), message
    assert "the model factory failed on rank 1" in message
    assert "--- rank 0 ---" not in message  # printed once: the root cause's error only


MODEL_FILE = '''
import torch
from commfx.models import load_model


def swapped():
    model, (ids,) = load_model("gpt-moe-tiny")
    return (ids,), model


def wrong_keyword():
    model, (ids,) = load_model("gpt-moe-tiny")
    return model, {"idx": ids}


def keywords():
    model, (ids,) = load_model("gpt-moe-tiny")
    return model, {"input_ids": ids}


def raises():
    raise RuntimeError("no weights here")
'''


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(MODEL_FILE)
    (tmp_path / "broken.py").write_text("def build(:\n    pass\n")
    return path


@pytest.mark.parametrize(
    "function, extra, message",
    [
        ("swapped", [], "returned (tuple, GPTMoE): the order is (model, example_inputs); swap them"),
        ("wrong_keyword", [], "input 'idx' is not a parameter of GPTMoE.forward; it takes input_ids."),
        ("raises", [], "raised RuntimeError: no weights here (at "),
        ("nope", [], "has no function 'nope'"),
        ("keywords", ["--batch", "3"], "--batch 3 does not apply to a model file"),
    ],
)
def test_model_file_errors_are_one_clear_line(capsys, model_file, function, extra, message):
    assert main(["dump", f"{model_file}:{function}", *extra]) == 2
    out = capsys.readouterr().out
    assert message in out.replace("\n", " ") and out.count("error:") == 1 and "Traceback" not in out


def test_model_file_syntax_error_names_the_line(capsys, model_file):
    assert main(["dump", f"{model_file.parent / 'broken.py'}:build"]) == 2
    assert "broken.py:1: syntax error" in capsys.readouterr().out


def test_model_file_may_return_keyword_inputs(capsys, model_file):
    assert main(["dump", f"{model_file}:keywords", "--world-size", "2"]) == 0
    assert "commfx.all_to_all" in capsys.readouterr().out


@pytest.mark.parametrize(
    "passes, message",
    [
        ("lift,partition_a2a", "--passes lift,expert_parallel,partition_a2a"),
        ("partition_a2a", "--passes lift,expert_parallel,partition_a2a"),
        ("lift,partition_a2a:k=2", "--passes lift,expert_parallel,partition_a2a:k=2"),
        (
            "partition_a2a,expert_parallel,lift",
            "needs lift, expert_parallel before it (the list has lift, expert_parallel after it); "
            "for example --passes lift,expert_parallel,partition_a2a",
        ),
        (
            "lift,expert_parallel,partition_a2a:k=2,grad_chunk_bytes=4096",
            "'grad_chunk_bytes=4096' is not a pass: it looks like an option. Options of one pass are separated by ';' "
            "and passes by ',': --passes \"lift,expert_parallel,partition_a2a:k=2;grad_chunk_bytes=4096\"",
        ),
        ("lift,expert_parallel:capacity_factor=1.25,k=2", '--passes "lift,expert_parallel:capacity_factor=1.25;k=2"'),
        ("lift,expert_parallel,partition_a2a:k=2:priority=true", "write 'partition_a2a:k=2;priority=true' instead"),
        ("lift;expert_parallel", "unknown pass 'lift;expert_parallel': passes are separated by ',' (--passes lift,expert_parallel)"),
        ("lift,expert-parallel", "unknown pass 'expert-parallel' (did you mean 'expert_parallel'?)"),
    ],
)
def test_pass_list_hints_keep_the_users_passes(capsys, no_launch, passes, message):
    assert main(["run", "gpt-moe-tiny", "--world-size", "2", "--passes", passes]) == 2
    out = capsys.readouterr().out
    assert message in out.replace("\n", "") and out.count("error:") == 1, out


@pytest.mark.distributed
@pytest.mark.parametrize(
    "worker, waited_in",
    [
        ("hangs_before_distribute", "rank(s) 1 did not reach commfx's rendezvous"),
        ("hangs_between_steps", "all_to_all on group 'ep' (a2a) did not finish within 4s on rank 0"),
    ],
)
def test_a_hung_rank_is_named_first_with_its_stack(worker, waited_in):
    """Rank 1 hangs in user code, before distribute or between two steps; rank 0 waits at the
    rendezvous or in a collective, bounded by Plan.collective_timeout_s (4 s here). The
    headline names rank 1, not rank 0 whose wait timed out; the launcher stops rank 1 and
    shows where it was, then rank 0's error."""
    message = launch_error(worker, hanging_rank=1)
    assert message.startswith(
        "rank 1 did not arrive: rank 0 waited for it in a collective until the time bound "
        "(Plan.collective_timeout_s, --collective-timeout); the launcher then stopped rank 1, still running."
    ), message
    stack, waited = message.split("--- rank 1, stopped by the launcher, was at ---")[1].split("--- rank 0, which waited ---")
    assert f"in {worker}" in stack
    assert waited_in in waited and "Original traceback" not in waited


def test_the_stack_shown_for_a_stopped_rank_is_its_main_threads_last_one(tmp_path):
    """SIGUSR1 lands on any thread of a rank; faulthandler calls that one "Current thread".
    The report shows the main thread's frames from the last dump, whichever thread took it."""
    from commfx.runtime.launcher import _last_stack

    def dump(main_frame: str) -> str:
        return (
            'Current thread 0x00007f0000000001 (most recent call first):\n'
            '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 10 in all_to_all\n'
            '  File "/src/commfx/runtime/priority.py", line 111 in _loop\n'
            '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
            'Thread 0x00007f0000000002 (most recent call first):\n'
            f'  File "/tests/dist_workers.py", line {main_frame}\n'
            '  File "/src/commfx/runtime/worker.py", line 83 in main\n'
            '  File "/src/commfx/runtime/worker.py", line 98 in <module>\n'
            '  File "<frozen runpy>", line 88 in _run_code\n\n'
        )

    (tmp_path / "log_1.txt").write_text("starting\n" + dump("300 in compile_graph") + "more output\n" + dump("318 in hangs_between_steps") + "gloo: bye\n")
    stack = _last_stack(tmp_path, 1)
    assert stack.startswith("Thread 0x00007f0000000002") and "line 318 in hangs_between_steps" in stack, stack
    assert "priority.py" not in stack and "compile_graph" not in stack, stack


@pytest.mark.distributed
def test_a_taken_master_port_is_retried_on_another_or_named(monkeypatch):
    """Two launchers on one machine can pick the same free port at once (xdist's workers do).
    Rank 0 of the later job cannot listen there: the launcher starts the job again on another
    port. A port the caller pinned is not changed: the error names it. (Keys of the rendezvous
    are under the job's name, so a rank given another job's port never joins that job.)"""
    import socket

    import commfx.runtime.launcher as launcher

    sys.path.insert(0, str(Path(__file__).parent))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picked, real_free_port = [], launcher.free_port

        def taken_first(host: str) -> int:
            picked.append(real_free_port(host) if picked else taken)
            return picked[-1]

        monkeypatch.setattr(launcher, "free_port", taken_first)
        assert launcher.launch("dist_workers:sum_of_ranks", 2, timeout_s=120) == [1, 1]
        assert picked[0] == taken and len(picked) == 2 and picked[1] != taken, picked

        with pytest.raises(launcher.LaunchError) as info:
            launcher.launch("dist_workers:sum_of_ranks", 2, timeout_s=120, master_port=taken)
        assert str(info.value) == (
            f"rank 0 could not listen on port {taken} of 127.0.0.1: another process holds it. "
            "Pass another master port, or none to let commfx pick a free one."
        )


def test_a_plan_error_under_torchrun_is_said_once_per_node(monkeypatch):
    """Every rank refuses a bad plan alike: local rank 0 prints the message, the others point to it."""
    import commfx
    from commfx.plan import Plan, PlanError

    bad = Plan.from_cli("lift,expert_parallel", world_size=2, pp=2)  # --pp without pipeline_split
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(PlanError, match="needs the pipeline_split pass"):
        commfx.backend(bad)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(PlanError, match=r"^the plan is refused on every rank; local rank 0 of this node prints why \(this is local rank 1\)$"):
        commfx.backend(bad)
