"""split_embedding_comm (EmbRace): lifted embeddings, the cost model, plan errors, golden
graphs, and float64 equality with dense data parallelism at world sizes 2 and 4 (outputs,
gradients, and parameters after 3 SGD and AdamW steps)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from commfx.api import compile_program
from commfx.compiler.lower import lower
from commfx.compiler.render import render
from commfx.models import load_model
from commfx.compiler.pass_manager import check_plan
from commfx.cost.embedding import choose, estimate
from commfx.plan import Plan, PlanError, Topology
from commfx.runtime.comm import install_default, local_scheduler
from commfx.runtime.launcher import launch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS / "model_files"))
sys.path.insert(0, str(TESTS))

from embedding_lm import VOCAB, EmbeddingLM, build  # noqa: E402
from test_golden import check_golden  # noqa: E402

commfx = torch.ops.commfx


def _program(model, passes, inputs, world_size=2):
    return compile_program(model, Plan.from_cli(passes, world_size=world_size), inputs)


# --------------------------------------------------------------------------------- lift


def test_lift_spells_every_lookup_with_the_canonical_op():
    model, inputs = build()
    program = _program(model, "lift", inputs, world_size=1)
    tables = {t.weight: t for t in program.regions.embeddings}
    assert set(tables) == {"tok.weight", "pos.weight", "kind"}  # nn.Embedding twice, F.embedding once
    assert tables["kind"].padding_idx == 0 and tables["tok.weight"].padding_idx == -1
    assert not any(t.tied for t in tables.values())
    targets = [n.target for n in program.graph.nodes]
    assert targets.count(commfx.embedding.default) == 3 and F.embedding not in targets
    install_default(local_scheduler())
    (out,) = program.gm(*inputs)
    torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0)


def test_lift_reports_a_table_tied_with_the_lm_head():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)
            self.lm_head = torch.nn.Linear(4, 16, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, ids):
            return self.lm_head(self.embed(ids))

    ids = torch.randint(0, 16, (2, 3))
    program = _program(Tied(), "lift,split_embedding_comm", (ids,))
    (table,) = program.regions.embeddings
    assert table.tied and table.tied_with == ["lm_head (linear)"]
    decision = program.decisions["split_embedding_comm"]["embed.weight"]
    assert decision["strategy"] == "dense" and "tied with lm_head" in decision["reason"]
    with pytest.raises(PlanError, match="tied with lm_head.weight: a tied table's gradient is dense"):
        check_plan(Plan.from_cli("lift,split_embedding_comm:strategy=sparse;tables=embed", world_size=2), Tied())
    with pytest.raises(PlanError, match="no table to apply to"):
        check_plan(Plan.from_cli("lift,split_embedding_comm:strategy=shard", world_size=2), Tied())
    with pytest.raises(PlanError, match="strategy=shard needs commfx.distribute"):
        from commfx.backend import backend

        backend(Plan.from_cli("lift,split_embedding_comm:strategy=shard", world_size=2))


def test_hf_tied_embeddings_are_dense_and_untied_ones_are_lifted():
    from commfx.models import load_model as load

    tied, inputs = load(f"{TESTS / 'model_files' / 'tied_embeddings.py'}:build")
    program = _program(tied, "lift,split_embedding_comm", inputs)
    (table,) = program.regions.embeddings
    assert table.weight == "model.embed_tokens.weight" and table.tied
    assert program.decisions["split_embedding_comm"]["model.embed_tokens.weight"]["strategy"] == "dense"
    with pytest.raises(PlanError, match="tied with lm_head.weight"):
        check_plan(Plan.from_cli("lift,split_embedding_comm:strategy=sparse;tables=model.embed_tokens", world_size=2), tied)


# ---------------------------------------------------------------------------- cost model


def test_cost_model_counts_bytes_and_picks_per_table():
    link = Topology(world_size=2, ranks_per_node=1, inter_node_bandwidth=12.5e6)  # 100 Mbit/s
    big = estimate(50_000, 64, 4, 1024, link, 2)
    assert big["dense"].bytes == 50_000 * 64 * 4  # ring all-reduce at P=2 sends the whole buffer once
    assert big["sparse"].bytes == 1024 * (64 * 4 + 8) + 8
    assert big["dense"].bytes >= 10 * big["sparse"].bytes
    assert big["shard"].bytes == 1024 * (2 * 64 * 4 + 8) // 2 + 8  # half the ids are this rank's own
    assert choose(big).strategy == "shard"  # fewer bytes by 4 per row; at P=2 the two are close
    assert choose(estimate(50_000, 64, 4, 16, link, 2)).strategy == "sparse"  # latency-bound: one collective fewer
    four = Topology(world_size=4, ranks_per_node=1, inter_node_bandwidth=12.5e6)
    assert choose(estimate(50_000, 64, 4, 1024, four, 4)).strategy == "shard"  # all-to-all beats P-1 copies
    assert choose(estimate(32, 16, 4, 4096, link, 2)).strategy == "dense"  # every row touched anyway
    assert not estimate(30, 16, 4, 8, four, 4)["shard"].applicable


def test_dump_shows_the_choice_and_its_numbers():
    model, inputs = build()
    text = render(_program(model, "lift,split_embedding_comm", inputs).gm)
    line = next(l for l in text.splitlines() if "tok.weight: " in l)
    assert "(cost model); per rank and step: sparse" in line and "shard" in line and "dense" in line


# ---------------------------------------------------------------------------- plan errors


@pytest.mark.parametrize(
    "options, world, message",
    [
        ("strategy=shard", 16, "tok.weight cannot be row-sharded: 12 rows are too few|pos.weight cannot be row-sharded: 12 rows are too few"),
        ("strategy=shard", 5, "rows do not divide over 5 ranks. Use strategy=sparse"),
        ("strategy=fast", 2, "strategy must be auto, sparse, shard, dense"),
        ("tables=nope", 2, "no embedding table nope; the model's tables are pos.weight, tok.weight"),
    ],
)
def test_plan_errors_name_the_table_and_the_fix(options, world, message):
    model, _ = build()
    with pytest.raises(PlanError, match=message):
        check_plan(Plan.from_cli(f"lift,split_embedding_comm:{options}", world_size=world), model)


# ---------------------------------------------------------------------------- golden graphs


def _texts(passes):
    model, inputs = load_model("gpt-moe-tiny")
    program = compile_program(model, Plan.from_cli(passes, world_size=2), inputs)
    lowered = lower(program, inputs)
    return {"distributed": render(program.gm), "forward": render(lowered.forward), "backward": render(lowered.backward)}


@pytest.mark.parametrize("strategy", ["sparse", "shard"])
def test_golden_embedding_graphs(strategy):
    texts = _texts(f"lift,expert_parallel,split_embedding_comm:strategy={strategy}")
    check_golden(texts, f"gpt-moe-tiny.ep2.embedding-{strategy}", ("distributed", "forward", "backward"))
    if strategy == "sparse":
        assert texts["backward"].count("commfx.exchange_row_grads(") == 2  # token and position tables
        assert "commfx.embedding_all_to_all(" not in texts["forward"]
    else:
        assert texts["forward"].count("commfx.embedding_all_to_all(") == 4  # ids out, rows back, two tables
        assert texts["backward"].count("(bw)'") == 2  # row gradients to owners
        assert "commfx.embedding_dense_grad(" in texts["backward"]  # the owner adds its rows


# ------------------------------------------------------------------ distributed, float64


def _assert_close(actual, expected, what):
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert actual.shape == expected.shape and difference <= 1e-10, f"{what}: {difference}"


def _full(results, strategy, key, name, placement):
    """A parameter or gradient as the world holds it (row shards concatenated)."""
    if name in placement:
        return torch.cat([r[strategy][key][name] for r in results])
    for r in results[1:]:
        _assert_close(r[strategy][key][name], results[0][strategy][key][name], f"{strategy} {key} {name} across ranks")
    return results[0][strategy][key][name]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size, rows", [(2, 7), (4, 9)])
def test_sparse_and_sharded_tables_equal_dense_data_parallelism(world_size, rows):
    from embedding_workers import reference

    strategies = ["sparse", "shard"]
    backend = world_size == 2
    results = launch(
        "embedding_workers:train_each_strategy", world_size, {"rows": rows, "strategies": strategies, "backend": backend},
        timeout_s=300, collective_timeout_s=60,
    )
    expected = reference(world_size, rows)
    dense_bytes = VOCAB * 8 * 8 * 2 * (world_size - 1) // world_size  # the tok table's all-reduce, float64
    for strategy in strategies:
        placement = results[0][strategy]["placement"]
        assert results[0][strategy]["decisions"] == {"tok.weight": strategy, "pos.weight": strategy, "kind": strategy}
        if strategy == "shard":
            assert set(placement) == {"tok.weight", "pos.weight", "kind"}
            assert results[0][strategy]["grads"]["tok.weight"].shape[0] == VOCAB // world_size  # memory is sharded
        output = torch.cat([r[strategy]["output"] for r in results])
        _assert_close(output, expected["output"], f"{strategy} outputs")
        for key in ("grads", "sgd", "adamw"):
            reference_values = expected["grads"] if key == "grads" else expected[key]
            for name, value in reference_values.items():
                _assert_close(_full(results, strategy, key, name, placement), value, f"{strategy} {key} {name}")
        for r in results:
            assert r[strategy]["compute_only_shape"] == tuple(r[strategy]["output"].shape)
            sent = r[strategy]["bytes"]
            assert sent["embedding_all_to_all"]["calls"] > 0
            embedding = sent["embedding_all_to_all"]["intra_node_bytes"]
            assert 0 < embedding < dense_bytes, (strategy, embedding, dense_bytes)
    if backend:  # torch.compile's door: sparse exchange, full-size tables owned by the user
        assert results[0]["backend"]["decisions"] == {"tok.weight": "sparse", "pos.weight": "sparse", "kind": "sparse"}
        _assert_close(torch.cat([r["backend"]["output"] for r in results]), expected["output"], "backend outputs")
        for name, value in expected["grads"].items():
            for r in results:
                _assert_close(r["backend"]["grads"][name], value, f"backend grad {name}")
