"""`commfx bench` on a stream of batches (commfx.bench.stream): plans with split_embedding_comm
and every plan of their run (peers too) train on a new global batch each step, token ids from
Zipf's law over the model's vocabulary, and the module is given the next step's batch; under
schedule=2d the trace shows the next batch's rows (class rows_next) on the wire before the
next step's lookups, ahead of the other rows (rows_later)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commfx.bench.stream import BatchStream, digest, model_vocabulary

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS / "model_files"))

from embedding_lm import VOCAB, build, build_loss  # noqa: E402
from bench_driver import DRIVER

MODEL = f"{TESTS / 'model_files' / 'embedding_lm.py'}:build"
TWO_D = "lift,split_embedding_comm:strategy=sparse;schedule=2d"


def test_the_stream_is_a_new_zipf_batch_each_step_and_the_same_for_a_step():
    model, (ids,) = build(7)
    stream = BatchStream(model_vocabulary(model), seed=3)
    batches = [stream.batch((ids,), step)[0] for step in range(4)]
    assert stream.vocab == VOCAB and all(b.shape == ids.shape and b.dtype == ids.dtype for b in batches)
    assert len({digest((b,)) for b in batches}) == 4  # every step differs
    assert torch.equal(stream.batch((ids,), 2)[0], batches[2])  # and is the same whenever asked for
    assert not torch.equal(BatchStream(VOCAB, seed=4).batch((ids,), 2)[0], batches[2])
    drawn = torch.cat([stream.batch((torch.zeros(64, 64, dtype=torch.long),), s)[0].flatten() for s in range(4)])
    assert 0 <= int(drawn.min()) and int(drawn.max()) < VOCAB
    counts = torch.bincount(drawn, minlength=VOCAB).double()
    # Zipf's law: id 0 about twice as frequent as id 1 and ten times id 9, far above uniform
    assert 1.6 < counts[0] / counts[1] < 2.5 and 6 < counts[0] / counts[9] < 15 and counts[0] > 8 * drawn.numel() / VOCAB


def test_next_token_labels_follow_the_new_ids_and_keep_ignored_positions():
    model, (ids, labels) = build_loss(7)
    new_ids, new_labels = BatchStream(model_vocabulary(model)).batch((ids, labels), 5)
    assert not torch.equal(new_ids, ids)
    assert torch.equal(new_labels[:, :-1], new_ids[:, 1:]) and (new_labels[:, -1] == -100).all()


def test_build_config_streams_embedding_runs_their_peers_too_and_refuses_what_cannot_stream():
    from commfx.bench.config import build_config

    def config(passes, *others, batches="auto"):
        return build_config(MODEL, passes, None, nodes=2, ranks_per_node=1, also=list(others), batches=batches)

    streamed = config(TWO_D, ("ddp", "peer:ddp"))
    assert streamed.stream == BatchStream(VOCAB, seed=0)
    assert config("lift").stream is None and config(TWO_D, batches="fixed").stream is None
    assert config("lift", batches="stream").stream is not None
    with pytest.raises(ValueError, match="peer:pipelining runs one fixed batch"):
        build_config("gpt-moe-tiny", "lift", "peer:pipelining", nodes=2, ranks_per_node=1, model_kwargs={"num_layers": 2}, batches="stream")
    with pytest.raises(ValueError, match="--batches must be auto, stream, fixed"):
        config("lift", batches="sometimes")


@pytest.mark.distributed
def test_bench_streams_batches_and_the_trace_shows_next_rows_before_the_next_lookups(tmp_path):
    """2 ranks on gloo, the 2d plan and peer:ddp, 2 measured rounds of 2 steps and a traced round."""
    out, traces = tmp_path / "bench.json", tmp_path / "traces"
    argv = [sys.executable, "-c", DRIVER, "bench", MODEL, "--passes", TWO_D, "--also", "ddp=peer:ddp",
            "--nodes", "2", "--ranks-per-node", "1", "--no-emulation", "--machine", "given", "--compute", "interpret",
            "--steps", "2", "--warmup", "0", "--steps-per-round", "2", "--timeout", "150", "--trace", str(traces), "--json", str(out)]
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:]
    batches = json.loads(out.read_text())["batches"]
    assert batches["distinct_measured"] == 4 and batches["same_for_every_plan"] is True, batches  # 2 rounds x 2 steps
    assert "Zipf" in batches["source"] and "4 different in the measured steps" in done.stdout
    events = [e for e in json.loads((traces / "plan.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["tid"] == 0)
        assert len(steps) == 2
        lookups = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"] == "commfx.row_embedding" and e["ts"] >= steps[1][0])
        assert len(lookups) == 3  # tok, pos and kind in step 1's forward
        # the row exchanges step 0's backward posted: its urgent ones before step 1's lookups (step 1
        # posts its own after them), its others the first two (ids, grads) of each table's in the
        # rows_later lane, which issues in order; those need not be in before the lookups
        sent = sorted((e for e in mine if e["args"].get("class") in ("rows_next", "rows_later") and not e["name"].startswith("queued")),
                      key=lambda e: e["ts"])
        urgent = [e for e in sent if e["args"]["class"] == "rows_next" and e["ts"] < lookups[-1][1]]
        assert urgent and all(e["name"].endswith("(rows_next)") for e in urgent)
        assert any(e["ts"] + e["dur"] <= lookups[0][0] for e in urgent), "no next-batch rows arrived before the next forward's lookups"
        assert all(e["ts"] + e["dur"] <= lookups[-1][1] for e in urgent)  # each table's next-batch rows in at its lookup
        for table in ("tok.weight", "pos.weight", "kind"):  # each table's next-batch rows go ahead of its other rows
            first = [e for e in urgent if e["name"].split()[1] == table]
            later = [e for e in sent if e["args"]["class"] == "rows_later" and e["name"].split()[1] == table][:2]
            assert first and len(later) == 2, table
            assert max(e["ts"] + e["dur"] for e in first) <= min(e["ts"] for e in later), table
