"""Nothing the user owns is deleted or overwritten, and every output and checkpoint problem is
one line before any rank starts (issue 41): exports into a user's directory, overlapping
outputs, schedules that save nothing, contradictory flags, unwritable or misnamed paths,
and every resume check `commfx.json` allows. One checkpoint, saved once by two ranks,
serves the resume checks; the failure of one rank's save raises on every rank at once."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from commfx.checkpoint import store
from commfx.cli.main import main

from test_cli_checks import no_launch, one_error  # noqa: F401  (no_launch is a fixture)

HF = "hf:qwen3_moe"


def user_directory(root: Path) -> Path:
    """A directory of the user's own: a note and a data file in a subdirectory."""
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    (root / "sub" / "data.csv").write_text("1,2\n")
    return root


def untouched(root: Path) -> bool:
    return (root / "notes.txt").read_text() == "mine" and (root / "sub" / "data.csv").read_text() == "1,2\n"


# ---------------------------------------------------------------- exports


def test_export_into_a_users_directory_is_refused_and_deletes_nothing(capsys, no_launch, tmp_path):
    mine = user_directory(tmp_path / "userdir")
    out = one_error(capsys, ["run", HF, "--world-size", "2", "--steps", "2", "--export", str(mine)])
    assert f"--export {mine}: {mine} holds notes.txt, sub and is not an earlier commfx export" in out, out
    assert "commfx never deletes files it did not write" in out and untouched(mine)


def test_export_over_the_checkpoint_directory_is_refused(capsys, no_launch, tmp_path):
    target = tmp_path / "outx"
    out = one_error(capsys, ["run", HF, "--world-size", "2", "--steps", "2", "--checkpoint-dir", str(target),
                             "--checkpoint-every", "1", "--export", str(target)])
    assert f"--export {target} and --checkpoint-dir {target} overlap" in out, out


def test_an_output_file_inside_the_export_is_refused(capsys, no_launch, tmp_path):
    out = one_error(capsys, ["run", HF, "--world-size", "2", "--steps", "1", "--export", str(tmp_path / "hf"),
                             "--json", str(tmp_path / "hf" / "run.json")])
    assert "--export" in out and f"--json {tmp_path / 'hf' / 'run.json'} overlap" in out, out


def test_export_hf_writes_aside_replaces_only_an_earlier_export_and_refuses_the_rest(tmp_path, monkeypatch):
    """export_hf itself (the Python API's door) on one rank: a new directory, then the same
    one again (an earlier export: replaced), then a user's directory (refused, untouched)."""
    import torch

    import commfx.checkpoint.hf as hf
    from commfx.checkpoint import CheckpointError
    from commfx.models import load_model

    model = load_model(HF, seed=0)[0]

    class OneRank:
        rank = 0

        def all_gather_object(self, value):
            return [value]

    dm = type("Module", (), {"program": type("Program", (), {"modules": {"": model}})(), "scheduler": OneRank()})()
    monkeypatch.setattr(hf, "gather_full", lambda _dm: {n: t.detach().clone() for n, t in model.state_dict().items()})
    target = hf.export_hf(dm, tmp_path / "export")
    first = json.loads((target / hf.EXPORT_MARK).read_text())
    assert "config.json" in first["files"] and any(f.endswith(".safetensors") for f in first["files"]), first
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    hf.export_hf(dm, target)  # an earlier export: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "the partial or old directory was left behind"
    from safetensors.torch import load_file

    saved = load_file(next(target.glob("*.safetensors")))
    assert torch.equal(saved["lm_head.weight"], model.lm_head.weight)
    (target / "notes.txt").write_text("mine")  # the user adds a file to the export: it is theirs now
    with pytest.raises(CheckpointError, match="holds notes.txt and is an earlier commfx export with files added"):
        hf.export_hf(dm, target)
    assert (target / "notes.txt").read_text() == "mine"
    mine = user_directory(tmp_path / "userdir")
    with pytest.raises(CheckpointError, match="failed on rank 0: .* is not an earlier commfx export"):
        hf.export_hf(dm, mine)
    assert untouched(mine)


# ---------------------------------------------------------------- flags and paths


def test_a_schedule_that_saves_nothing_is_refused(capsys, no_launch, tmp_path):
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                             "--checkpoint-every", "10"])
    assert "--checkpoint-every 10 with --steps 2 saves no checkpoint (the first would follow step 10)" in out, out


def test_bf16_with_float64_weights_is_refused(capsys, no_launch):
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--precision", "bf16", "--dtype", "float64"])
    assert "--precision bf16 keeps float32 master weights" in out and "--dtype float64 asks for float64 weights" in out, out


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc (Linux)")
def test_a_path_no_file_can_be_made_in_is_refused_by_trying(capsys, no_launch):
    """/proc exists and root passes os.access there, but no file can be created in it: refused
    before the ranks, not 'internal error ... a commfx defect' after the run."""
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--json", "/proc/x.json"])
    assert "--json /proc/x.json: cannot write there: /proc does not take new files" in out and "defect" not in out, out


def test_a_checkpoint_directory_that_is_a_file_is_refused(capsys, no_launch, tmp_path):
    script = tmp_path / "r.sh"
    script.write_text("echo mine\n")
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--checkpoint-dir", str(script)])
    assert f"--checkpoint-dir {script}: cannot write there: {script} is a file, not a directory" in out, out
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--resume", str(script)])
    assert f"checkpoint {script} is a file, not a checkpoint directory" in out, out
    assert script.read_text() == "echo mine\n"


def test_a_manifest_without_its_file_list_is_a_damaged_checkpoint(capsys, no_launch, tmp_path):
    checkpoint = tmp_path / "step-000001"
    checkpoint.mkdir()
    (checkpoint / store.MANIFEST).write_text(json.dumps({"format": store.FORMAT, "step": 1}))
    out = one_error(capsys, ["run", "gpt-moe-tiny", "--world-size", "2", "--resume", str(checkpoint)])
    assert "has no 'form', 'layout', 'tensors', 'files': the manifest is damaged" in out and "internal error" not in out, out


# ---------------------------------------------------------------- resume, checked from commfx.json


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """gpt-moe-tiny after 2 steps of lift,expert_parallel,partition_a2a on two ranks."""
    root = tmp_path_factory.mktemp("saved") / "ck"
    assert main(["run", "gpt-moe-tiny", "--world-size", "2", "--steps", "2", "--passes", "lift,expert_parallel,partition_a2a",
                 "--checkpoint-dir", str(root)]) == 0
    assert (root / "step-000002" / store.MANIFEST).exists()
    return root


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("gpt-moe-tiny", ["--steps", "2"], "the checkpoint was saved after step 2 and --steps 2 leaves nothing to train; give --steps above 2"),
        ("gpt-moe-tiny", ["--steps", "4", "--dtype", "float64"], "holds float32 parameters and this run is float64: resume with --dtype float32"),
        ("gpt-moe", ["--steps", "4"], "holds another model than gpt-moe (not in it:"),
    ],
)
def test_resume_checks_run_before_any_rank_starts(capsys, saved, no_launch, model, extra, message):
    out = one_error(capsys, ["run", model, "--world-size", "2", "--resume", str(saved), *extra])
    assert message in out, out


@pytest.mark.distributed
def test_resume_drops_a_stateless_pass_at_another_world_size(capfd, saved):
    """Saved by lift,expert_parallel,partition_a2a on 2 ranks; resumed by lift,expert_parallel
    on 1 (partition_a2a keeps no state): it trains steps 3 and 4."""
    assert main(["run", "gpt-moe-tiny", "--world-size", "1", "--steps", "4", "--passes", "lift,expert_parallel", "--resume", str(saved)]) == 0
    out = capfd.readouterr().out  # rank 0 streams its lines from its own process
    assert "resumed from" in out and "after step 2" in out and "step   3/4" in out and "step   4/4" in out, out


def test_dropped_and_added_stateful_passes_are_noted():
    from commfx.checkpoint.per_layout import pass_changes

    assert pass_changes(["lift", "expert_parallel", "partition_a2a"], ["lift", "expert_parallel"]) == []
    notes = pass_changes(["lift", "expert_parallel", "pack_experts"], ["lift", "expert_parallel", "compress_pipeline"])
    assert notes == [
        "pack_experts is not in this plan: its expert placements and routing statistics from the checkpoint are dropped",
        "compress_pipeline is new in this plan: its error-feedback residuals and PowerSGD factors start fresh",
    ], notes


# ---------------------------------------------------------------- one rank's failure is every rank's


@pytest.mark.distributed
def test_a_save_that_fails_on_rank_0_raises_on_every_rank_at_once(tmp_path):
    """Rank 0 cannot make the directory (its parent is a file); rank 1 used to wait 120 s in a
    barrier. Both raise within seconds: rank 0 with the cause, rank 1 pointing to rank 0."""
    from commfx.runtime.launcher import launch

    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    sys.path.insert(0, str(Path(__file__).parent))
    start = time.perf_counter()
    ranks = launch("checkpoint_workers:save_fails_on_rank0", 2, {"root": str(blocker / "ck"), "model": "gpt-moe-tiny",
                   "passes": "lift,expert_parallel"}, timeout_s=200, collective_timeout_s=60)
    assert time.perf_counter() - start < 60
    zero, one = ranks[0]["error"], ranks[1]["error"]
    assert zero.startswith(f"saving a checkpoint to {blocker / 'ck'} failed on rank 0: FileExistsError") or zero.startswith(
        f"saving a checkpoint to {blocker / 'ck'} failed on rank 0: NotADirectoryError"), zero
    assert one == f"saving a checkpoint to {blocker / 'ck'} failed on rank 0 (rank 0 prints why); rank 1 stopped with it", one
    assert max(r["seconds"] for r in ranks) < 10, ranks


def test_a_top_k_above_the_experts_is_refused_before_any_rank(capsys, no_launch):
    """It used to print torch's 'k not in range' traceback from inside capture."""
    out = one_error(capsys, ["bench", HF, "--vs", "peer:deepspeed_moe", "--model-arg", "num_experts_per_tok=5"])
    assert "hf:qwen3_moe: num_experts_per_tok=5 but the model has 4 experts" in out and "Traceback" not in out, out


def test_ctrl_c_while_the_command_imports_ends_with_one_line(monkeypatch, capsys):
    """SIGINT while torch and commfx are still importing (the first seconds of every command)
    ends with exit 130 and one line, never a KeyboardInterrupt traceback: the entry point
    (src/commfx_cli.py) imports the command inside its own handler. The import is made to
    raise KeyboardInterrupt here, as a Ctrl-C at that moment does."""
    import types

    import commfx_cli

    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "commfx.cli.main", Interrupted("commfx.cli.main"))
    assert commfx_cli.main() == 130
    captured = capsys.readouterr()
    assert captured.err == "interrupted (SIGINT) while starting: no rank had started\n" and "Traceback" not in captured.out, captured


def test_a_shared_failure_prints_on_the_rank_that_failed():
    """Rank 1 failed a save, every rank raised it: rank 1 prints the error, rank 0 one pointer
    line; an exception that is not a commfx user error is left to Python's traceback."""
    import io

    from commfx.checkpoint.agree import SharedFailure
    from commfx.runtime.rank_errors import print_once

    failure = SharedFailure("saving a checkpoint to ck failed on rank 1: PermissionError: denied", first_rank=1)
    streams = [io.StringIO(), io.StringIO()]
    assert all(print_once(failure, rank, streams[rank]) for rank in (0, 1))
    assert streams[0].getvalue() == "rank 0 stopped: SharedFailure (rank 1 prints it)\n"
    assert streams[1].getvalue() == "error: saving a checkpoint to ck failed on rank 1: PermissionError: denied\n"
    assert not print_once(KeyError("a defect"), 0, io.StringIO())


def test_a_pointing_rank_waits_for_the_printing_rank_bounded():
    """torchrun stops every rank once one exits: the rank that only points waits until the
    printing rank has printed (recorded in the store), and gives up after its bound."""
    import threading
    import time

    import torch.distributed as dist

    from commfx.runtime.rank_errors import hand_over

    store = dist.HashStore()
    start = time.monotonic()
    hand_over(rank=0, first=1, store=store, wait_s=0.3)
    assert time.monotonic() - start >= 0.25  # nobody printed: it waited its bound, then went on
    printer = threading.Timer(0.2, hand_over, kwargs=dict(rank=1, first=1, store=store))
    start = time.monotonic()
    printer.start()
    hand_over(rank=0, first=1, store=store, wait_s=30)
    assert 0.15 <= time.monotonic() - start < 10
    printer.join()


GRAPH_BREAK_SCRIPT = '''\
import torch, torch.distributed as dist, commfx
from commfx.models import load_model
from commfx.models.gpt_moe import MoEBlock

class PrintsBetweenRouterAndExperts(MoEBlock):
    def forward(self, h):
        b, s, d = h.shape
        x = h.reshape(-1, d)
        weights, indices = self.router(x)
        print("routed")
        return self.experts(x, indices, weights).reshape(b, s, d)

dist.init_process_group("gloo")
model, (ids,) = load_model("gpt-moe-tiny")
for layer in model.layers:
    block = PrintsBetweenRouterAndExperts(model.config)
    block.load_state_dict(layer.moe.state_dict())
    layer.moe = block
plan = commfx.Plan.from_cli("lift,expert_parallel", world_size=dist.get_world_size())
torch.compile(model, backend=commfx.backend(plan, model=model))(ids).sum().backward()
'''


@pytest.mark.distributed
def test_a_graph_break_between_router_and_experts_is_named_once_under_torchrun(tmp_path):
    """It ended in 'lift: cannot find the top-k expert indices entering experts' after about 45
    lines of BackendCompilerFailed per rank; now one line names the break's file and line."""
    import os
    import subprocess

    script = tmp_path / "breaks.py"
    script.write_text(GRAPH_BREAK_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout + done.stderr
    assert done.returncode != 0
    message = f"error: lift: a graph break at {script}:10 in forward, between the router and the experts at"
    assert out.count(message) == 1 and "(raised inside BackendCompilerFailed)" in out, out[-3000:]
    assert "rank 1 stopped: PassError (rank 0 prints it)" in out and "cannot find the top-k" not in out, out[-3000:]


@pytest.mark.parametrize("flags, environment, expected", [
    ([], None, "interpret"), (["--compute", "inductor"], None, "inductor"), ([], "inductor", "inductor"),
])
def test_verify_checks_the_rewrite_by_interpreting_unless_told(monkeypatch, flags, environment, expected):
    """Inductor's kernels differ from eager's in the last bits of a model's float32 islands (HF
    rotary embeddings), which a 1e-10 comparison would blame on the rewrite."""
    import commfx.verify

    class Seen(BaseException):  # past the command's own error handling
        pass

    def capture(cases, *args, **kwargs):
        raise Seen(cases[0].plan.compute)

    if environment is None:
        monkeypatch.delenv("COMMFX_COMPUTE", raising=False)
    else:
        monkeypatch.setenv("COMMFX_COMPUTE", environment)
    monkeypatch.setattr(commfx.verify, "verify", capture)
    with pytest.raises(Seen) as seen:
        main(["verify", "gpt-moe-tiny", "--world-size", "2", *flags])
    assert str(seen.value) == expected
