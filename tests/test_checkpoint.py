"""Checkpoints (commfx.save / commfx.load, `commfx run --checkpoint-dir/--resume/--export`):
a run killed mid-way and resumed ends equal, digit for digit in float64, to one never
interrupted; a checkpoint loads at another world and expert-parallel size; a partial,
corrupted or foreign checkpoint is refused by name; an exported HF model loads in
transformers with the trained weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commfx.checkpoint import CheckpointError, store

ROOT = Path(__file__).resolve().parent.parent
LINA_PACKED = "lift,expert_parallel,pack_experts:replace_every=2;balance=0.5,partition_a2a"
STEPS, EVERY = 30, 2


def commfx_run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "commfx", "run", "gpt-moe-tiny", "--passes", LINA_PACKED, "--dtype", "float64", "--timeout", "200", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found += [int(child), *_children(int(child))]
    return found


def _rank_pid(launcher: int, rank: int) -> int | None:
    for pid in _children(launcher):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"commfx.runtime.worker" in argv and argv[-2:] == [str(rank).encode(), b""]:
            return pid
    return None


def saved_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint at its full shape, read in this process (no ranks)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Lina's passes with packing re-placed every 2 steps, float64, 6 steps, saved every 2."""
    root = tmp_path_factory.mktemp("uninterrupted")
    done = commfx_run("--world-size", "2", "--steps", str(STEPS), "--checkpoint-dir", str(root / "ck"), "--checkpoint-every", str(EVERY),
                      "--json", str(root / "run.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_killed_by_sigkill_resumes_equal_to_one_never_interrupted(uninterrupted, tmp_path):
    """Rank 1 is SIGKILLed once step 4's checkpoint exists; the run resumed from the last
    complete checkpoint ends with the same losses and the same parameters, optimizer
    moments and expert placement (every saved tensor, bit for bit) as the run never
    interrupted, and a re-placement happened before the kill (the placement was restored)."""
    ck = tmp_path / "ck"
    argv = [sys.executable, "-m", "commfx", "run", "gpt-moe-tiny", "--passes", LINA_PACKED, "--dtype", "float64", "--timeout", "200",
            "--world-size", "2", "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", str(EVERY)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    crashed = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (ck / "step-000004" / store.MANIFEST).exists():
            assert crashed.poll() is None and time.monotonic() < deadline, "the run ended or stalled before its step-4 checkpoint"
            time.sleep(0.02)
        victim = _rank_pid(crashed.pid, 1)
        assert victim is not None, "rank 1's process was not found"
        os.kill(victim, signal.SIGKILL)
        out, _ = crashed.communicate(timeout=120)
    finally:
        if crashed.poll() is None:
            crashed.kill()
            crashed.wait(timeout=30)
    assert crashed.returncode != 0 and "rank 1" in out and "killed by signal 9" in out, out[-2000:]
    last = int(store.resolve(ck).name.removeprefix("step-"))
    assert 4 <= last < STEPS, f"the kill came after the last step ({last}): the run was not interrupted"
    resumed = commfx_run("--world-size", "2", "--steps", str(STEPS), "--resume", str(ck), "--checkpoint-dir", str(ck),
                         "--checkpoint-every", str(EVERY), "--json", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"after step {last}" in resumed.stdout, resumed.stdout
    full = json.loads((uninterrupted / "run.json").read_text())
    again = json.loads((tmp_path / "resumed.json").read_text())
    assert [r["step"] for r in again["history"]] == list(range(last + 1, STEPS + 1))
    assert [r["loss"] for r in again["history"]] == [r["loss"] for r in full["history"][last:]]
    assert again["expert_placement"] == full["expert_placement"]
    assert full["expert_placement"]["layers.0.moe.experts"]["replacements"] >= 1, "no expert ever moved (the test proves less)"
    final = store.step_name(STEPS)
    expected, got = saved_tensors(uninterrupted / "ck" / final), saved_tensors(ck / final)
    assert sorted(expected) == sorted(got) and any(k.startswith("optimizer/") for k in got)
    assert expected["model/lm_head.weight"].dtype == torch.float64
    unequal = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not unequal, unequal


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_of_two_ranks_resumes_on_one(uninterrupted, tmp_path):
    """World 2 -> 1 (dp and ep 2 -> 1, packed experts re-placed for one rank): the same
    function, so the losses after step 4 agree to float64 rounding."""
    resumed = commfx_run("--world-size", "1", "--steps", "6", "--resume", str(uninterrupted / "ck" / "step-000004"),
                         "--json", str(tmp_path / "one.json"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resharded: world_size 2 -> 1" in resumed.stdout, resumed.stdout
    full = json.loads((uninterrupted / "run.json").read_text())["history"][4:6]
    one = json.loads((tmp_path / "one.json").read_text())["history"]
    assert [r["step"] for r in one] == [5, 6]
    for a, b in zip(full, one):
        assert abs(a["loss"] - b["loss"]) <= 1e-12, (a["loss"], b["loss"])


def test_partial_and_corrupted_checkpoints_are_refused_by_name(uninterrupted, tmp_path):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(uninterrupted / "ck", root)
    final = store.step_name(STEPS)
    assert store.resolve(root).name == final
    (root / ".step-999998.partial").mkdir()  # a save that died: never loaded
    assert store.resolve(root).name == final
    checkpoint = root / final
    data = sorted(checkpoint.glob("*.distcp"))[0]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"{data}.*corrupted.*earlier step"):
        store.read_manifest(checkpoint)
    for sealed in root.glob("step-*/" + store.MANIFEST):
        sealed.unlink()  # unsealed: not checkpoints
    with pytest.raises(CheckpointError, match="no complete checkpoint.*step-999998.partial.*never loaded"):
        store.resolve(root)
    refused = subprocess.run([sys.executable, "-m", "commfx", "run", "gpt-moe-tiny", "--world-size", "2", "--resume", str(root)],  # before any rank
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no complete checkpoint" in refused.stdout, refused.stdout + refused.stderr


def _launch(function: str, world_size: int, **kwargs):
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    return launch(f"checkpoint_workers:{function}", world_size, kwargs, timeout_s=300, collective_timeout_s=60)


def _equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.distributed
def test_packed_experts_reshard_from_two_ranks_to_four_and_back(tmp_path):
    """ep 2 -> 4 -> 2 with pack_experts (placements re-solved for 4 ranks from the saved
    statistics, then for 2): every expert, moment and placement-independent tensor loads
    bit for bit at each layout, and the losses continue as the 2-rank run's to 1e-12."""
    passes = LINA_PACKED
    two = _launch("train_and_save", 2, root=str(tmp_path / "a"), model="gpt-moe-tiny", passes=passes, steps=5, save_at=3)[0]
    assert two["placements"]["layers.0.moe.experts"] != [0, 1, 2, 3], "no re-placement before the save (the test proves less)"
    four = _launch("load_and_train", 4, root=str(tmp_path / "a"), model="gpt-moe-tiny", passes=passes, steps=2, save_as=str(tmp_path / "b"))[0]
    assert not _equal(two["at_save"], four["loaded"]), _equal(two["at_save"], four["loaded"])
    assert any("re-placed for 4 ranks" in n for n in four["notes"]), four["notes"]
    for a, b in zip(two["losses"][3:], four["losses"]):
        assert abs(a - b) <= 1e-12, (two["losses"], four["losses"])
    back = _launch("load_and_train", 2, root=str(tmp_path / "b"), model="gpt-moe-tiny", passes=passes, steps=1)[0]
    assert not _equal(four["state"], back["loaded"]), _equal(four["state"], back["loaded"])
    assert any("re-placed for 2 ranks" in n for n in back["notes"]), back["notes"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_foreign_checkpoint_is_refused_by_name(tmp_path):
    """Another model is refused naming the manifest and what differs; another plan over the
    same model loads it (a checkpoint is the model's state)."""
    _launch("train_and_save", 2, root=str(tmp_path), model="gpt-moe-tiny", passes="lift,expert_parallel", steps=1, save_at=1)
    other_model = _launch("load_refused", 2, root=str(tmp_path), model="gpt-moe", passes="lift,expert_parallel")[0]
    assert "commfx.json holds another model" in other_model and "load it into the model" in other_model, other_model
    other_plan = _launch("load_refused", 2, root=str(tmp_path), model="gpt-moe-tiny", passes="lift,expert_parallel,partition_a2a")[0]
    assert other_plan == "", other_plan


@pytest.mark.slow
@pytest.mark.distributed
def test_an_exported_hf_model_loads_in_transformers_with_the_trained_weights(tmp_path):
    """export_hf after 2 steps of expert-parallel training on 2 ranks: from_pretrained gives
    every trained parameter bit for bit and the distributed model's logits exactly."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "hf"
    ranks = _launch("export_hf_model", 2, directory=str(directory), model="hf:mixtral", passes="lift,expert_parallel,partition_a2a", steps=2)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")
    params = dict(model.named_parameters())
    trained = ranks[0]["state"]
    assert set(params) <= set(trained), set(params) - set(trained)
    assert not [n for n in params if not torch.equal(params[n], trained[n])]
    model.train()
    with torch.no_grad():
        for r in ranks:
            assert torch.equal(model(r["batch"][0]).logits, r["logits"].logits)


@pytest.mark.distributed
def test_the_readme_torchrun_recipe_saves_resumes_and_exports(tmp_path):
    """examples/checkpoint_resume.py as the README runs it, as small as it goes: 2 steps
    saved, then resumed from step 2 for one more step with an export in the layout
    from_pretrained reads (test_an_exported_hf_model_... loads one in transformers). The
    resumed run adds shard_states:stage=3 (the README's ZeRO recipe; a layout pass may be
    added on resume), so its optimizer is commfx.shard_optimizer's."""
    from test_examples import losses, torchrun

    ck, hf = tmp_path / "ck", tmp_path / "hf"
    first = torchrun("checkpoint_resume.py", "--steps", "2", "--checkpoint-dir", str(ck))
    assert len(losses(first)) == 2 and (ck / "step-000002" / store.MANIFEST).exists(), first
    second = torchrun("checkpoint_resume.py", "--steps", "3", "--checkpoint-dir", str(ck), "--resume", "--export", str(hf),
                      "--passes", "lift,expert_parallel,partition_a2a,shard_states:stage=3")
    assert "step 3/3" in second and "step 1/3" not in second and "step 2/3" not in second, second
    assert json.loads((hf / "config.json").read_text())["num_local_experts"] == 4 and list(hf.glob("*.safetensors")), second


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_continues(saved: dict, *resumed: dict, saved_at: int = 2) -> None:
    """The first resumed run loaded, bit for bit, what `saved` held at its step `saved_at`, and
    the resumed runs' losses, one after another, continue `saved`'s from there."""
    assert _max_diff(saved["at_save"], resumed[0]["loaded"]) == 0
    later = [loss for run in resumed for loss in run["losses"]]
    for a, b in zip(saved["losses"][saved_at:], later):
        assert abs(a - b) <= 1e-12, (saved["losses"], later)


def _saved_chunks(checkpoint: Path, fqn: str) -> int:
    """How many chunks of `fqn` the checkpoint's files hold (a replicated tensor: one)."""
    from torch.distributed.checkpoint import FileSystemReader

    return sum(1 for index in FileSystemReader(checkpoint).read_metadata().storage_data if index.fqn == fqn)


TIED = str(ROOT / "tests" / "model_files" / "tied_pipeline.py") + ":build"


@pytest.mark.distributed
def test_pipeline_stages_reshard_from_two_stages_to_one(tmp_path):
    """pp 2 -> 1 on a model whose head is tied to its embedding (held by both stages, saved
    once under its model-level name; the pp=1 plan without pipeline_split): each stage's
    parameters and AdamW moments load bit for bit, and the losses continue as the 2-stage run's."""
    two = _launch("train_and_save", 2, root=str(tmp_path), model=TIED, passes="lift,pipeline_split", steps=4, save_at=2, pp=2)[0]
    saved = tmp_path / "step-000002"
    assert _saved_chunks(saved, "model/embed.weight") == 1 and _saved_chunks(saved, "optimizer/embed.weight/exp_avg") == 1
    assert "model/head.weight" not in json.loads((saved / store.MANIFEST).read_text())["tensors"]
    one = _launch("load_and_train", 1, root=str(tmp_path), model=TIED, passes="lift", steps=2)[0]
    assert "resharded: world_size 2 -> 1, pp 2 -> 1" in one["notes"], one["notes"]
    _assert_continues(two, one)


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_stages_reshard_from_one_stage_to_two(tmp_path):
    """pp 1 -> 2: a checkpoint of the unsplit model loads into each stage's share, the tied
    weight into both, bit for bit, and the losses continue as the 1-rank run's."""
    one = _launch("train_and_save", 1, root=str(tmp_path), model=TIED, passes="lift", steps=4, save_at=2)[0]
    two = _launch("load_and_train", 2, root=str(tmp_path), model=TIED, passes="lift,pipeline_split", steps=2, pp=2)[0]
    assert "resharded: world_size 1 -> 2, pp 1 -> 2" in two["notes"], two["notes"]
    _assert_continues(one, two)


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_reshards_from_two_ranks_to_one_and_back(tmp_path):
    """tp 2 -> 1 -> 2 (world 2 -> 1 -> 2; the tp=1 plan without tensor_parallel): every
    head and moment loads bit for bit, and the losses continue as the tp=2 run's."""
    tp_passes = "lift,tensor_parallel"
    two = _launch("train_and_save", 2, root=str(tmp_path / "a"), model="gpt-moe-tiny", passes=tp_passes, steps=5, save_at=2, tp=2)[0]
    one = _launch("load_and_train", 1, root=str(tmp_path / "a"), model="gpt-moe-tiny", passes="lift", steps=2, save_as=str(tmp_path / "b"))[0]
    assert any("tp 2 -> 1" in n for n in one["notes"]), one["notes"]
    back = _launch("load_and_train", 2, root=str(tmp_path / "b"), model="gpt-moe-tiny", passes=tp_passes, steps=1, tp=2)[0]
    assert _max_diff(one["state"], back["loaded"]) == 0
    _assert_continues(two, one, back)


@pytest.mark.slow
@pytest.mark.distributed
def test_compress_pipeline_state_resumes_at_its_layout_and_is_refused_at_another(tmp_path):
    """compress_pipeline's error feedback and PowerSGD Q are saved per stage: resumed at
    pp=2 the losses continue bit for bit; at pp=1 the checkpoint is refused naming it."""
    passes = "lift,pipeline_split,compress_pipeline:rank=2;epilogue_only=false"
    two = _launch("train_and_save", 2, root=str(tmp_path), model=TIED, passes=passes, steps=4, save_at=2, pp=2)[0]
    again = _launch("load_and_train", 2, root=str(tmp_path), model=TIED, passes=passes, steps=2, pp=2)[0]
    assert again["losses"] == two["losses"][2:], (two["losses"], again["losses"])
    refused = _launch("load_refused", 1, root=str(tmp_path), model=TIED, passes="lift")[0]
    assert "compress_pipeline state saved per layout" in refused and "pp 2 -> 1" in refused, refused


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_optimizer_state_reshards_to_a_replicated_plan_and_another_stage(tmp_path):
    """shard_states: ZeRO-3 on 2 ranks (small buckets, so ranges cut parameters mid-row)
    -> a replicated plan on 1 rank -> ZeRO-1 on 2 ranks with other buckets: each rank's
    flat moment shards are chunks of the model-level moments, so every parameter and moment
    loads bit for bit and the losses continue as the first run's."""
    ep = "lift,expert_parallel"
    zero3, zero1 = f"{ep},shard_states:stage=3;bucket_bytes=2048", f"{ep},shard_states:stage=1;bucket_bytes=1000"
    first = _launch("train_and_save", 2, root=str(tmp_path / "a"), model="gpt-moe-tiny", passes=zero3, steps=5, save_at=2)[0]
    one = _launch("load_and_train", 1, root=str(tmp_path / "a"), model="gpt-moe-tiny", passes=ep, steps=2, save_as=str(tmp_path / "b"))[0]
    assert any(k.startswith("optimizer/") and k.endswith("exp_avg_sq") for k in one["loaded"])
    back = _launch("load_and_train", 2, root=str(tmp_path / "b"), model="gpt-moe-tiny", passes=zero1, steps=1)[0]
    assert _max_diff(one["state"], back["loaded"]) == 0
    _assert_continues(first, one, back)
