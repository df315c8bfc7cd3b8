"""split_embedding_comm:schedule=2d (EmbRace's 2D communication scheduling): embedding row
gradients exchanged into the next forward, the next batch's rows first; the next lookup
waits for those only and steps just the rows it reads, the others are stepped once theirs
arrive. Lossless: on a stream of batches (rows no batch reads, rows one step updates and
the next reads), 4 SGD/Adam/AdamW steps under an LR scheduler give schedule=step's losses,
parameters and optimizer state and dense data parallelism's parameters (float64), across a
checkpoint save and resume too, and with the other rows held on the wire past the next
lookup; Adagrad, whose step is not split by rows, steps each table whole and is lossless too;
the exchange goes in two priority classes; plan errors."""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS / "model_files"))
sys.path.insert(0, str(TESTS))

from commfx.api import compile_program  # noqa: E402
from commfx.compiler.lower import lower  # noqa: E402
from commfx.compiler.pass_manager import check_plan  # noqa: E402
from commfx.plan import Plan, PlanError  # noqa: E402
from commfx.runtime.launcher import launch  # noqa: E402
from commfx.runtime.row_schedule import hoist_row_posts, next_rows  # noqa: E402
from embedding_lm import VOCAB, build  # noqa: E402

commfx = torch.ops.commfx
STEPS, ROWS = 4, 7
SPARSE = "lift,split_embedding_comm:strategy=sparse"
SHARD = "lift,split_embedding_comm:strategy=shard"


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _whole(results, key, placement):
    """Parameters as the world holds them (row shards concatenated)."""
    return {n: torch.cat([r[key][n] for r in results]) if n in placement else results[0][key][n] for n in results[0][key]}


def _check(results, base, optimizers, reference, save_at=0):
    later = f"{base};schedule=2d"
    for name in optimizers:
        step = [r[(base, name)] for r in results]
        two_d = [r[(later, name)] for r in results]
        for s, t in zip(step, two_d):
            assert t["pending_before_sync"] and t["caught_up"] > 0, (later, name)  # rows really were on the wire into the next step
            assert t["settled_by_eval"] and (s["eval"] - t["eval"]).abs().max() <= 1e-10  # an eval call settles every table
            # the next batch's rows in the urgent class, the others behind the gradients; none under schedule=step
            assert t["row_bytes"].get("rows_next", 0) > 0 and t["row_bytes"].get("rows_later", 0) > 0, t["row_bytes"]
            assert not s["row_bytes"]
            assert max(abs(a - b) for a, b in zip(s["losses"], t["losses"])) <= 1e-10
        for s, t in zip(step, two_d):  # optimizer state too: moments, momentum, one step count per step
            assert s["optimizer_state"].keys() == t["optimizer_state"].keys()
            for param, state in s["optimizer_state"].items():
                assert state.keys() == t["optimizer_state"][param].keys()
                for key, value in state.items():
                    assert (torch.as_tensor(value).double() - torch.as_tensor(t["optimizer_state"][param][key]).double()).abs().max() <= 1e-10, (param, key)
            _check_split(t, len(t["losses"]), save_at, by_rows=name != "adagrad")
        placement = step[0]["placement"]
        difference = _max_difference(_whole(two_d, "params", placement), _whole(step, "params", placement))
        assert difference <= 1e-10, (later, name, difference)
        dense = _max_difference(_whole(two_d, "params", placement), reference[name])
        assert dense <= 1e-10, (later, name, "vs dense data parallelism", dense)
        if "resumed" in two_d[0]:
            resumed = [t["resumed"] for t in two_d]
            for s, t in zip(step, resumed):
                assert max(abs(a - b) for a, b in zip(s["losses"][-len(t["losses"]):], t["losses"])) <= 1e-10
            assert _max_difference(_whole(resumed, "params", placement), _whole(step, "params", placement)) <= 1e-10


def _check_split(result, steps, save_at=0, by_rows=True):
    """Each table's missed steps: at each next lookup the rows it reads stepped (a part of
    the table), then the others, every row once; one a checkpoint (after step `save_at`)
    or the end of training settled, whole at synchronize(). Not `by_rows`: all whole."""
    tables = {table for _, table, _, _ in result["events"]}
    assert tables == {"tok.weight", "pos.weight", "kind"}
    for table in tables:
        events = [(what, rows) for what, name, _, rows in result["events"] if name == table]
        stepped = [e for e in events if e[0] != "lookup"]
        local = result["local_rows"][table]
        expected = [w for step in range(1, steps + 1) for w in (["whole"] if step in (save_at, steps) or not by_rows else ["next", "later"])]
        assert [what for what, _ in stepped] == expected, (table, stepped)
        for index, (what, count) in enumerate(events):
            if what == "next":
                assert events[index - 1][0] == "lookup"  # stepped by the lookup, before it reads
                later = next(e for e in events[index + 1:] if e[0] != "lookup")
                assert later[0] == "later" and count + later[1] == local
            assert what != "whole" or count == local
    tok = [rows for what, name, _, rows in result["events"] if name == "tok.weight" and what == "next"]
    assert all(0 < rows < result["local_rows"]["tok.weight"] for rows in tok) and len(tok) == (steps - 1 - bool(save_at)) * by_rows


@pytest.mark.distributed
@pytest.mark.parametrize("base, optimizers", [(SPARSE, ["sgd", "adamw", "adagrad"]), (SHARD, ["adam", "adamw"])])
def test_2d_equals_step_and_dense_data_parallelism(base, optimizers):
    from embedding_workers import stream_reference

    plans = [base, f"{base};schedule=2d"]
    results = launch("embedding_workers:train_stream", 2, {"rows": ROWS, "plans": plans, "optimizers": optimizers, "steps": STEPS},
                     timeout_s=300, collective_timeout_s=60)
    _check(results, base, optimizers, stream_reference(2, ROWS, optimizers, STEPS))


@pytest.mark.distributed
def test_2d_across_a_checkpoint_save_and_resume(tmp_path):
    """commfx.save settles the tables (dm.synchronize); a module resumed from it trains on to the same parameters."""
    from embedding_workers import stream_reference

    plans = [SHARD, f"{SHARD};schedule=2d"]
    args = {"rows": ROWS, "plans": plans, "optimizers": ["adamw"], "steps": STEPS, "save_at": 2, "checkpoint_dir": str(tmp_path / "ckpt")}
    results = launch("embedding_workers:train_stream", 2, args, timeout_s=300, collective_timeout_s=60)
    _check(results, SHARD, ["adamw"], stream_reference(2, ROWS, ["adamw"], STEPS), save_at=2)
    assert "resumed" in results[0][(f"{SHARD};schedule=2d", "adamw")]


def test_the_stream_has_rows_one_step_updates_and_the_next_reads_and_rows_never_read():
    """The premise of the tests above: some rows of tok are read two steps running, others never."""
    from embedding_workers import stream_batch

    batches = [set(stream_batch(ROWS, step).flatten().tolist()) for step in range(STEPS + 1)]
    assert all(a & b and a != b for a, b in zip(batches, batches[1:]))
    assert not set().union(*batches) & set(range(40, VOCAB))


@pytest.mark.distributed
def test_the_lookup_waits_only_for_its_rows():
    """Each step's rows_later exchanges are held on the wire until the next step's forward is
    done: the lookups step the rows they read before those exchanges finish and the other
    rows after, and the parameters are still dense data parallelism's."""
    from embedding_workers import stream_reference

    plans = [f"{SPARSE};schedule=2d", f"{SHARD};schedule=2d"]
    results = launch("embedding_workers:train_stream", 2, {"rows": ROWS, "plans": plans, "optimizers": ["adamw"], "steps": STEPS,
                     "hold_later": True}, timeout_s=300, collective_timeout_s=60)
    reference = stream_reference(2, ROWS, ["adamw"], STEPS)
    for passes in plans:
        runs = [r[(passes, "adamw")] for r in results]
        for run in runs:
            _check_split(run, STEPS)
            for table in ("tok.weight", "pos.weight", "kind"):
                firsts = [t for what, name, t, _ in run["events"] if name == table and what == "next"]
                rests = [t for what, name, t, _ in run["events"] if name == table and what == "later"]
                done = run["later_done"][table][: STEPS - 1]
                assert len(firsts) == len(rests) == len(done) == STEPS - 1
                for first, arrived, rest in zip(firsts, done, rests):
                    assert first < arrived <= rest, (passes, table, first, arrived, rest)
        assert _max_difference(_whole(runs, "params", runs[0]["placement"]), reference["adamw"]) <= 1e-10


def _program(passes, world_size=2):
    model, inputs = build(ROWS)
    return compile_program(model.double(), Plan.from_cli(passes, world_size=world_size), inputs), inputs


@pytest.mark.parametrize("base", [SPARSE, SHARD])
def test_the_next_batch_rows_come_from_the_graphs_own_id_computation(base):
    """next_rows runs the captured graph's nodes between the inputs and each lookup's ids:
    tok reads the ids, pos the positions, kind ids % 8."""
    program, (ids,) = _program(f"{base};schedule=2d")
    other = ids.flip(0)[:3] + 1
    rows = next_rows(program.gm, (other,))
    assert set(rows) == {"tok.weight", "pos.weight", "kind"}
    assert torch.equal(rows["tok.weight"], other.unique()) and torch.equal(rows["kind"], (other % 8).unique())
    assert torch.equal(rows["pos.weight"], torch.arange(ids.shape[1]))


def test_the_backward_posts_row_gradients_as_early_as_their_inputs_allow():
    program, inputs = _program(f"{SPARSE};schedule=2d")
    backward = lower(program, inputs).backward
    posts = [n for n in backward.graph.nodes if n.target is commfx.post_row_grads.default]
    assert len(posts) == 3
    hoist_row_posts(backward)
    position = {n: i for i, n in enumerate(backward.graph.nodes)}
    for previous, post in zip([None, *posts], posts):
        anchors = [*post.all_input_nodes, *([previous] if previous is not None else [])]
        assert post.prev is max(anchors, key=position.__getitem__)  # right after its last input: nothing waits before it
    assert position[posts[0]] < position[next(n for n in backward.graph.nodes if n.name == "getitem_4")]  # before the norm's weight gradient


@pytest.mark.parametrize(
    "passes, message",
    [
        (f"{SPARSE};schedule=later", "schedule must be step or 2d; got 'later'"),
    ],
)
def test_schedule_plan_errors(passes, message):
    model, _ = build(ROWS)
    with pytest.raises(PlanError, match=message):
        check_plan(Plan.from_cli(passes, world_size=2), model)


def test_2d_under_torch_compile_is_a_plan_error():
    from commfx.backend import backend

    with pytest.raises(PlanError, match="schedule=2d needs commfx.distribute"):
        backend(Plan.from_cli(f"{SPARSE};schedule=2d", world_size=2))


def test_2d_shards_replicated_over_ep_groups_are_refused():
    from commfx.passes.base import PassError

    model, inputs = build(ROWS)
    with pytest.raises(PassError, match="replicated over 2 ep groups"):
        compile_program(model, Plan.from_cli(f"{SHARD};schedule=2d", world_size=4, ep=2), inputs)
