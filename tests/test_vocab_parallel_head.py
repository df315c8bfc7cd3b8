"""split_embedding_comm head=shard: an LM head split over the vocabulary (ops/vocab_parallel.py).

lift_heads finds a head whose logits feed only a cross-entropy loss and says why it keeps
the others; the cost model; plan and pass errors; the golden graph; and float64 equality
with dense data parallelism at world sizes 2 and 4 (each rank's loss, every gradient, and
the parameters after 3 SGD and AdamW steps), uneven batches and ignored labels included."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from commfx.compiler.render import render
from commfx.models import NextTokenLoss
from commfx.compiler.pass_manager import check_plan
from commfx.passes.base import PassError
from commfx.cost.embedding import choose, estimate_head
from commfx.plan import Plan, PlanError, Topology
from commfx.runtime.launcher import launch
from commfx.verify import VerifyCase, verify

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS / "model_files"))
sys.path.insert(0, str(TESTS))

from embedding_lm import VOCAB, EmbeddingLM, build_loss  # noqa: E402
from test_embedding_comm import _program  # noqa: E402
from test_golden import check_golden  # noqa: E402

commfx = torch.ops.commfx


def test_lift_records_a_head_whose_logits_feed_only_the_loss():
    model, inputs = build_loss(4)
    program = _program(model, "lift", inputs)
    (head,) = program.regions.lm_heads
    assert head.weight == "lm.head.weight" and (head.num_rows, head.dim) == (VOCAB, 8)
    assert head.ignore_index == -100 and head.reduction == "mean"
    assert commfx.vocab_parallel_loss.default not in [n.target for n in program.graph.nodes]  # lift only records


class LossAndLogits(torch.nn.Module):
    def __init__(self, **loss_options):
        super().__init__()
        self.lm, self.loss_options = EmbeddingLM(), loss_options

    def forward(self, ids, labels):
        logits = self.lm(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **self.loss_options)
        return (loss, logits) if not self.loss_options else loss


class TiedLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        return F.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    "model, reason",
    [
        (LossAndLogits(), "its logits are used by more than the loss"),
        (LossAndLogits(label_smoothing=0.1), "label smoothing"),
        (TiedLoss(), "used elsewhere too (a tied embedding)"),
    ],
)
def test_lift_keeps_heads_that_cannot_be_split_and_says_why(model, reason):
    ids = torch.randint(0, 16, (4, 6))
    program = _program(model, "lift", (ids, ids))
    assert program.regions.lm_heads == []
    (kept,) = program.regions.kept_heads
    assert reason in kept
    dumped = _program(model, "lift,split_embedding_comm", (ids, ids)).notes  # what commfx dump prints first
    assert any("LM head stays dense" in note and reason in note for note in dumped), dumped
    with pytest.raises(PassError, match="head=shard: the graph has no LM head to split.*" + reason.split(" (")[0]):
        _program(model, "lift,split_embedding_comm:head=shard", (ids, ids))


def test_cost_model_splits_a_large_vocabulary_and_keeps_a_small_one_dense():
    topology = Topology(world_size=2, ranks_per_node=1)
    big = estimate_head(50_000, 64, 4, 512, topology, 2)
    assert big["dense"].bytes == 50_000 * 64 * 4  # a ring all-reduce at P=2 sends the buffer once
    assert big["shard"].bytes == 512 * (2 * 64 * 4 + 8 + 2 * 2 * 4) + 16
    assert choose(big).strategy == "shard"
    small = estimate_head(64, 8, 4, 4096, topology, 2)
    assert choose(small).strategy == "dense"
    assert not estimate_head(63, 8, 4, 16, topology, 2)["shard"].applicable


def test_head_errors_say_what_to_do():
    model, inputs = build_loss(4)
    with pytest.raises(PlanError, match="head must be auto, shard or dense"):
        check_plan(Plan.from_cli("lift,split_embedding_comm:head=rows", world_size=2), model)
    with pytest.raises(PlanError, match="head=shard needs commfx.distribute"):
        from commfx.backend import backend

        backend(Plan.from_cli("lift,split_embedding_comm:head=shard", world_size=2))
    odd = NextTokenLoss(torch.nn.Sequential(torch.nn.Embedding(63, 4), torch.nn.Linear(4, 63, bias=False)))
    ids = torch.randint(0, 63, (4, 6))
    with pytest.raises(PassError, match="cannot be split over the vocabulary: 63 rows do not divide over 2 ranks"):
        _program(odd, "lift,split_embedding_comm:head=shard", (ids, ids))


def test_golden_vocab_parallel_head_graphs():
    model, inputs = build_loss(4)
    program = _program(model, "lift,split_embedding_comm:head=shard;strategy=dense", inputs)
    text = render(program.gm)
    assert "commfx.vocab_parallel_loss" in text and "cross_entropy" not in text
    from commfx.compiler.lower import lower

    lowered = lower(program, tuple(t[:2] for t in inputs))
    texts = {"distributed": text, "forward": render(lowered.forward), "backward": render(lowered.backward)}
    assert "vocab_parallel_loss_backward" in texts["backward"]
    check_golden(texts, "embedding-lm-loss.ep2.head-shard", ("distributed", "forward", "backward"))


def _close(actual, expected, what):
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert actual.shape == expected.shape and difference <= 1e-10, f"{what}: {difference}"


@pytest.mark.distributed
def test_split_head_equals_dense_data_parallelism_over_three_optimizer_steps():
    """World 2, an uneven batch (7 rows): every rank's loss, every gradient, and the
    parameters after 3 SGD and 3 AdamW steps, head split and head dense."""
    from embedding_workers import loss_reference

    world_size, rows = 2, 7
    results = launch("embedding_workers:train_each_head", world_size, {"rows": rows, "heads": ["shard", "dense"]}, timeout_s=300, collective_timeout_s=60)
    expected = loss_reference(world_size, rows)
    for head in ("shard", "dense"):
        assert results[0][head]["decisions"]["lm.head.weight"] == head
        _close(torch.stack([r[head]["loss"] for r in results]), expected["losses"], f"{head} losses")
        placement = results[0][head]["placement"]
        assert ("lm.head.weight" in placement) == (head == "shard")
        for key in ("grads", "sgd", "adamw"):
            for name, value in expected[key].items():
                parts = [r[head][key][name] for r in results]
                full = torch.cat(parts) if name in placement else parts[0]
                if name not in placement:
                    for other in parts[1:]:
                        _close(other, full, f"{head} {key} {name} across ranks")
                _close(full, value, f"{head} {key} {name}")
    shard, dense = results[0]["shard"]["bytes"], results[0]["dense"]["bytes"]
    assert shard["head_all_to_all"]["calls"] == 6  # counts, hidden states, labels, log-sum-exp; loss gradients, hidden gradients
    assert "head_all_to_all" not in dense
    head_bytes = VOCAB * 8 * 8  # float64 head gradient; a ring all-reduce at P=2 sends it once
    assert dense["grad_all_reduce"]["intra_node_bytes"] - shard["grad_all_reduce"]["intra_node_bytes"] == head_bytes


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ep", [4, 2])
def test_verify_split_head_at_world_four(ep):
    """commfx verify's check (float64, every gradient) at world 4 on 9 rows: ranks of 3, 2,
    2, 2; the head split over all four ranks, or over ep=2 and replicated over the rest."""
    plan = Plan.from_cli("lift,split_embedding_comm:head=shard", world_size=4, ep=ep)
    (report,) = verify([VerifyCase(str(TESTS / "model_files" / "embedding_lm.py") + ":build_loss_9", plan)], 4, timeout_s=300)
    assert report.ok, report.failures
    assert report.grad_diffs["lm.head.weight"] <= 1e-10 and report.tokens_per_rank == [18, 12, 12, 12]
