"""resize_tp: ZERO-resizing, lossless migration and the SEMI-migration controller.

Single-process tests check the op against its definition (Y = X[..., S] W[:, S]^T, zeros
imputed in backward), priority selection, the controller's decision rule and the plan
errors, and that tensor_parallel's unit functions (one head, one block of MLP columns)
sum over all units to the block. One gloo launch at tp=2 (float64, gpt-moe-tiny) checks
column migration against plain tensor parallelism: S = every column is the same function,
migration is exact (one step, and AdamW steps with migration on then off), a real resize
changes the function but not one collective's shape, shard widths survive state_dict, and
every rank takes the same decisions from its own noisy timings. Another (tp=2, and tp=4
marked slow; a dense model, float64) checks unit migration: outputs and gradients exact,
no collective added, undo restores every parameter bit for bit, AdamW (weight decay on)
with units moved, moved again and moved back equals AdamW without, the layout and slots
survive state_dict, and the controller migrates units the same way on every rank.
"""

from __future__ import annotations

import pytest
import torch

from commfx.compiler.lower import lower
from commfx.compiler.pipeline import compile_program
from commfx.models import load_model
from commfx.plan import Plan, PlanError
from commfx.runtime.comm import active, local_scheduler
from commfx.runtime.launcher import launch
from commfx.runtime.resize.columns import priority_columns
from commfx.runtime.resize.resizer import Resizer
from commfx.runtime.semi import SemiConfig, SemiState, decide

commfx = torch.ops.commfx


def test_a_resized_linear_contracts_over_the_kept_columns_and_imputes_zeros():
    scheduler = local_scheduler()
    weight = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    resizer = Resizer({"w": (weight, "column")}, scheduler.op_state, tp_rank=0, tp_size=2)
    kept = [0, 2, 5]
    resizer.resize(0.5, kept={"w": kept})
    with active(scheduler):
        y = commfx.tp_linear(x, weight, bias, "w", "tp")
        probe = torch.randn_like(y)
        gx, gw, gb = torch.autograd.grad((y * probe).sum(), (x, weight, bias))
    xs, ws = x.detach()[..., kept].requires_grad_(), weight.detach()[:, kept].requires_grad_()
    b = bias.detach().requires_grad_()
    expected = torch.nn.functional.linear(xs, ws, b)
    ex, ew, eb = torch.autograd.grad((expected * probe).sum(), (xs, ws, b))
    assert torch.allclose(y, expected, atol=1e-12, rtol=0)
    dropped = [1, 3, 4]
    assert torch.equal(gx[..., dropped], torch.zeros_like(gx[..., dropped]))  # imputed: zero, same shape
    assert torch.equal(gw[:, dropped], torch.zeros_like(gw[:, dropped]))
    assert torch.allclose(gx[..., kept], ex, atol=1e-12) and torch.allclose(gw[:, kept], ew, atol=1e-12)
    assert torch.allclose(gb, eb, atol=1e-12)
    assert gx.shape == x.shape and gw.shape == weight.shape
    assert 0 < resizer.error() < 1  # what the dropped half left out, relative


def test_priority_keeps_the_columns_that_changed_most():
    weight = torch.zeros(3, 5)
    snapshot = weight.clone()
    weight[:, 4] = 2.0
    weight[:, 1] = 1.0
    weight[0, 2] = 0.5
    assert priority_columns(weight, snapshot, 2) == [1, 4]
    assert priority_columns(weight, snapshot, 3) == [1, 2, 4]
    assert priority_columns(torch.ones(2, 4), None, 2) == [0, 1]  # ties: lower index first
    # the next selection ranks by change since this one
    resizer = Resizer({"w": (weight, "row")}, {}, tp_rank=0, tp_size=2)
    resizer.resize(0.4)
    assert resizer.plan("w").columns.kept == [1, 4]
    weight[:, 0] += 3.0
    weight[:, 3] += 1.0
    resizer.resize(0.4)
    assert resizer.plan("w").columns.kept == [0, 3]


def test_resize_and_migration_fractions_out_of_range_are_clear_errors():
    resizer = Resizer({"w": (torch.randn(4, 6), "row")}, {}, tp_rank=0, tp_size=2)
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=r"resize fraction must be in \(0, 1\]"):
            resizer.resize(bad)
    with pytest.raises(ValueError, match=r"migration fraction must be in \[0, 1\)"):
        resizer.migrate(0, 1, 1.0)
    with pytest.raises(ValueError, match="two different tp ranks"):
        resizer.migrate(1, 1, 0.5)
    resizer.resize(0.5)
    assert len(resizer.plan("w").columns.kept) == 3
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"resize fraction must be in \(0, 1\] \(the share of units"):
            resizer.request_unit_resize(bad)
    model, inputs = load_model("gpt-moe-tiny")
    with pytest.raises(PlanError, match=r"tolerance=-0.1 must be >= 0"):
        compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp:tolerance=-0.1", world_size=2, tp=2), inputs)
    with pytest.raises(PlanError, match=r"min_fraction=1.5 is out of range.*\(0, 1\]"):
        compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp:min_fraction=1.5", world_size=2, tp=2), inputs)
    with pytest.raises(PlanError, match="mode must be one of semi, resize, migrate, off"):
        compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp:mode=fast", world_size=2, tp=2), inputs)
    with pytest.raises(PlanError, match=r"needs the tensor_parallel pass, e.g. --passes lift,tensor_parallel,resize_tp$"):
        compile_program(model, Plan.from_cli("lift,resize_tp", world_size=2, tp=2), inputs)


def test_every_tp_linear_becomes_resizable_and_the_graph_keeps_its_collectives():
    model, inputs = load_model("gpt-moe-tiny")
    program = compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp", world_size=2, tp=2), inputs)
    linears = program.runtime.tp_resize["linears"]
    assert linears == {"layers.0.attn.qkv.weight": {"kind": "column"}, "layers.0.attn.proj.weight": {"kind": "row"}}
    assert sum(1 for n in program.graph.nodes if n.target is commfx.tp_linear.default) == 2
    # what `commfx dump` prints about it: what moves, and the options SEMI decides with
    [note] = [n for n in program.notes if n.startswith("resize_tp:")]
    assert "whole units of 1 block(s) (layers.0.attn)" in note and "tolerance 0.05" in note and "min_fraction=0.25" in note
    lowered = lower(program, inputs)
    assert sum(1 for n in lowered.backward.graph.nodes if n.target is commfx.tp_linear_backward.default) == 2
    # the same tp collectives as plain tensor parallelism: widths never reach the graph
    assert sum(1 for n in lowered.forward.graph.nodes if n.target is commfx.all_reduce.default) == 1
    assert sum(1 for n in lowered.backward.graph.nodes if n.target is commfx.all_reduce.default) == 1


def _decide(times, work, state, **config):
    """The decision with lossless migration only unless a tolerance is given (the balance rule)."""
    config.setdefault("tolerance", float("inf"))
    return decide(times, work, state, SemiConfig(**config), bytes_per_column_step=1e6, bandwidth=1e9)


def test_semi_resizes_light_or_transient_slowness_and_migrates_heavy_persistent_slowness():
    state = SemiState()
    first = _decide([0.10, 0.25], [1.0, 1.0], state, persist_windows=2)
    assert (first.action, first.straggler) == ("resize", 1) and first.fraction == pytest.approx(0.4)
    assert "transient" in first.why
    # resized to 40%: its time fell, but per unit of work it is as slow as before
    second = _decide([0.10, 0.10], [1.0, 0.4], state, persist_windows=2)
    assert second.action == "migrate" and second.ratio == pytest.approx(2.5)
    assert second.fraction == pytest.approx(1.5 / 3.5)  # (1 - m) 2.5 == 1 + m: both ranks then take as long
    assert _decide([0.10, 0.10], [1.0, 0.4], SemiState(persistent=3, last_straggler=1), max_migrate=0.3).fraction == 0.3
    light = _decide([0.10, 0.12], [1.0, 1.0], SemiState(), threshold=0.1)
    assert light.action == "resize" and "light" in light.why
    expensive = decide([0.10, 0.3], [1.0, 1.0], SemiState(persistent=5, last_straggler=1), SemiConfig(), 1e12, 1e9)
    assert expensive.action == "resize" and "cost more" in expensive.why and expensive.move_s > expensive.excess_s
    recovered = _decide([0.10, 0.10], [1.0, 1.0], state)
    assert recovered.action == "restore" and recovered.fraction == 1.0
    assert "ratio 2.50" in second.line() and "migration 428,571 B = 0.4 ms/step" in second.line()  # logged with its numbers


def test_resizing_settles_where_a_straggler_with_a_fixed_part_matches_the_others_then_restores():
    """Rank 1 takes 0.05 s that do not shrink with its shard plus 0.15 s per whole shard
    (2x the others' 0.1 s). Time per unit of work would call a resized rank ever slower and
    resize it to the floor; the affine fit keeps the ratio at 2 and settles where both
    ranks take 0.1 s (f = 1/3). When the rank recovers (0.1 s per shard, nothing fixed) the
    fit across the change is unphysical, the proportional model says ratio 1: full width."""
    state, fraction, decisions = SemiState(), 1.0, []
    for _ in range(4):
        d = _decide([0.10, 0.05 + 0.15 * fraction], [1.0, fraction], state, mode="resize")
        decisions.append(d)
        fraction = d.fraction
    assert [d.action for d in decisions] == ["resize"] * 4
    assert decisions[0].fraction == pytest.approx(0.5)  # one window: t = b w, so 1 / ratio
    assert all(d.ratio == pytest.approx(2.0) for d in decisions)
    assert all(d.fraction == pytest.approx(1 / 3) for d in decisions[1:])  # 0.05 + 0.15 f == 0.1
    recovered = _decide([0.10, 0.1 * fraction], [1.0, fraction], state, mode="resize")
    assert recovered.action == "restore" and recovered.ratio == pytest.approx(1.0)


def test_semi_migrates_what_it_can_and_resizes_the_rest_when_migration_alone_cannot_balance():
    heavy = dict(times=[0.10, 0.20], work=[1.0, 1.0], bytes_per_column_step=1e6, bandwidth=1e9)
    # 40% of the work is row-parallel: balancing a 2x straggler needs (2-1)/(2+1)/0.4 = 83% of
    # those columns, over max_migrate=0.5; so move half (20% of the work) and keep (1+0.2)/(2*0.8).
    semi = decide(state=SemiState(persistent=3, last_straggler=1), config=SemiConfig(max_migrate=0.5, migrate="columns"), migratable=0.4, **heavy)
    assert (semi.action, semi.fraction) == ("migrate", 0.5) and semi.keep == pytest.approx(0.75)
    assert "cannot balance" in semi.why and "keep 0.75" in semi.line()
    only = decide(state=SemiState(persistent=3, last_straggler=1), config=SemiConfig(mode="migrate", max_migrate=0.5, migrate="columns"), migratable=0.4, **heavy)
    assert (only.action, only.fraction, only.keep) == ("migrate", 0.5, 1.0)  # mode=migrate never resizes
    # lossless only (tolerance inf): a 9x straggler needs 80% of its units moved, 75% go, nothing dropped
    units = decide([0.10, 0.90], [1.0, 1.0], SemiState(persistent=3, last_straggler=1), SemiConfig(tolerance=float("inf")), 1e6, 1e9)
    assert (units.action, units.fraction, units.keep) == ("migrate", 0.75, 1.0) and "cannot balance" in units.why
    # tolerance 0.1: the others take what fits in 1.1 x their 0.1 s (10%), the straggler
    # keeps (0.11 - 0) / (0.9 x 0.9) = 14% of the rest, held at min_fraction
    budget = decide([0.10, 0.90], [1.0, 1.0], SemiState(persistent=3, last_straggler=1), SemiConfig(tolerance=0.1), 1e6, 1e9)
    assert (budget.action, budget.keep) == ("migrate", 0.25) and budget.fraction == pytest.approx(0.1)
    # ... unless 10% is under one unit of any block (rounding moves nothing): it resizes
    rounded = decide([0.10, 0.90], [1.0, 1.0], SemiState(persistent=3, last_straggler=1), SemiConfig(tolerance=0.1), 1e6, 1e9, unit_share=0.125)
    assert (rounded.action, rounded.fraction) == ("resize", 0.25) and "10% would be under one unit" in rounded.why
    enough = decide(state=SemiState(persistent=3, last_straggler=1), config=SemiConfig(tolerance=float("inf")), migratable=1.0, **heavy)
    assert enough.action == "migrate" and enough.fraction == pytest.approx(1 / 3) and enough.keep == 1.0


def test_semi_with_units_migrates_what_the_others_absorb_within_the_tolerance_and_resizes_the_rest():
    """Rank 1 at half speed: 0.02 s fixed + 0.2 s per shard, rank 0 0.01 + 0.1. Balanced by
    migration alone both would take 0.11 + 0.1 m = 0.22 - 0.2 m, m = 0.367: 0.147 s, 1.33x
    rank 0's 0.11 s. With tolerance 0.1 (target 0.121 s) rank 0 takes m = 0.011 / 0.1 = 11%
    and rank 1 keeps k of the rest: 0.02 + 0.2 (1 - 0.11) k = 0.121, k = 0.567. Tolerance
    0.4 admits the balanced step: lossless. Where nothing fits (tolerance 0), it resizes."""
    state = SemiState(persistent=3, last_straggler=1)
    state.windows = [[[0.11, 0.22], [1.0, 1.0]], [[0.06, 0.12], [0.5, 0.5]]]
    d = decide([0.11, 0.22], [1.0, 1.0], state, SemiConfig(max_migrate=0.9, tolerance=0.1), 0.0, 1e9)
    assert d.action == "migrate" and d.fraction == pytest.approx(0.11) and d.keep == pytest.approx(0.101 / (0.2 * 0.89))
    assert "over (1 + tolerance 0.1)" in d.why and "keeps 57% of the rest" in d.why
    state = SemiState(persistent=3, last_straggler=1)
    state.windows = [[[0.11, 0.22], [1.0, 1.0]], [[0.06, 0.12], [0.5, 0.5]]]
    lossless = decide([0.11, 0.22], [1.0, 1.0], state, SemiConfig(max_migrate=0.9, tolerance=0.4), 0.0, 1e9)
    assert lossless.action == "migrate" and lossless.keep == 1.0 and lossless.fraction == pytest.approx(0.11 / 0.3)
    state = SemiState(persistent=3, last_straggler=1)
    state.windows = [[[0.11, 0.22], [1.0, 1.0]], [[0.06, 0.12], [0.5, 0.5]]]
    none = decide([0.11, 0.22], [1.0, 1.0], state, SemiConfig(max_migrate=0.9, tolerance=0.0), 0.0, 1e9)
    assert none.action == "resize" and none.fraction == pytest.approx(0.09 / 0.2)


def test_semi_undoes_a_migration_measured_slower_than_doing_nothing():
    """Rank 1 is 2x slower (0.2 s at full width). SEMI migrates; the two windows after, the
    slowest rank takes 0.22 s, slower than 0.2 s with nothing done: SEMI resizes instead,
    says why, and does not migrate again until the rank recovers. A migration that helps
    (0.15 s) stays."""
    config = dict(state=SemiState(persistent=3, last_straggler=1), config=SemiConfig(migrate="columns"), bytes_per_column_step=1e6, bandwidth=1e9)
    state = config["state"]
    first = decide([0.10, 0.20], [1.0, 1.0], **{k: v for k, v in config.items()})
    assert first.action == "migrate" and state.before_migration_s == pytest.approx(0.20)
    moved = first.fraction
    once = decide([0.13, 0.22], [1.0 + moved, 1.0 - moved], **config)
    assert once.action == "migrate"  # one slow window may be the machine's
    worse = decide([0.13, 0.22], [1.0 + moved, 1.0 - moved], **config)
    assert worse.action == "resize" and "migration measured slower" in worse.why and "220.0 ms" in worse.why
    again = decide([0.10, 0.20 * worse.fraction], [1.0, worse.fraction], **config)
    assert again.action == "resize"  # heavy and persistent still, but not migrated again
    assert decide([0.10, 0.10], [1.0, 1.0], **config).action == "restore" and not state.migration_failed
    good = dict(config, state=SemiState(persistent=3, last_straggler=1))
    decide([0.10, 0.20], [1.0, 1.0], **good)
    assert decide([0.14, 0.15], [1.0 + moved, 1.0 - moved], **good).action == "migrate"
    for _ in range(2):
        assert decide([0.14, 0.15], [1.0 + moved, 1.0 - moved], **good).action == "migrate"
    # judged right after it starts only: the machine slowing down later is not the migration's fault
    assert all(decide([0.182, 0.195], [1.0 + moved, 1.0 - moved], **good).action == "migrate" for _ in range(3))


def test_resizing_migration_and_the_controller_at_tp2():
    results = launch("resize_workers:resize_suite", 2, {}, timeout_s=300)
    for result in results:
        assert result["plain_untouched"] == 0.0  # resize_tp with nothing resized is plain tp
        assert result["all_kept"] == 0.0  # S = every column, through the resizing path: bit for bit
        assert result["migrated"] <= 1e-10  # migration is lossless
        assert result["migration_bytes"]["calls"] == 2 and result["migration_bytes"]["intra_node_bytes"] > 0
        assert result["restored"] == 0.0  # undone: plain tp again
        assert result["resized"] > 1e-3  # rank 1 at half width really computes something else
        # imputation: every collective has the same kind, group, shape and dtype as plain tp's
        assert result["records_resized"] == result["records_plain"] == result["records_reference"]
        assert [r[0] for r in result["records_plain"]] == ["tp_all_reduce", "tp_all_reduce"]
        assert result["kept_after_load"] == result["kept"]  # shard widths survive state_dict
        assert result["training_diff"] <= 1e-10  # AdamW with migration on, then off, is AdamW
    assert results[1]["error"] > 0 and results[0]["error"] == 0  # only the resized rank reports an error
    assert len(results[1]["kept"]["layers.0.attn.qkv.weight"]) == 8 and results[0]["kept"]["layers.0.attn.qkv.weight"] is None
    # the same decisions on both ranks, from clocks that disagree
    assert results[0]["seen"] != results[1]["seen"]
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["actions"] == ["resize", "migrate", "migrate", "restore"]
    assert all(result["restored_at_end"] for result in results)


def test_unit_functions_sum_over_all_units_to_the_block():
    """tensor_parallel's unit function for a block, run on each unit's weight slices of the
    whole (unsharded) model, sums to the block's output less its bias: a fused-qkv attention
    block (a unit is a head) and an MLP (a unit is a block of columns)."""
    import resize_workers

    model, ids = resize_workers.dense_tiny()
    program = compile_program(model, Plan.from_cli("lift,tensor_parallel", world_size=2, tp=2), (ids,))
    units = {block.path: block.unit_function for block in program.regions.tp_blocks if block.unit_function is not None}
    assert sorted(units) == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]
    assert (units["layers.1.attn"]["unit"], units["layers.1.mlp"]["unit"]) == (1, 4)  # a head; 32 columns per rank in 8 blocks
    layer = model.layers[1]
    h = torch.randn(2, 6, 32, dtype=torch.float64)

    def whole(function, x, sizes, units, weights):
        """weights: (tensor, dim, (outer, inner)) -- the unit's slice is outer x unit x inner."""
        out = 0
        for u in range(0, units, function["unit"]):
            slices = []
            for w, d, (outer, inner) in weights:
                rows = torch.arange(outer * units * inner).view(outer, units, inner)[:, u : u + function["unit"], :].reshape(-1)
                slices.append(w.index_select(d, rows))
            out = out + function["graph"](function["unit"], x, *sizes, *slices)
        return out

    mlp = units["layers.1.mlp"]
    expected = layer.mlp.down(torch.nn.functional.gelu(layer.mlp.up(h))) - layer.mlp.down.bias
    got = whole(mlp, h, [], 64, [(layer.mlp.up.weight, 0, (1, 1)), (layer.mlp.up.bias, 0, (1, 1)), (layer.mlp.down.weight, 1, (1, 1))])
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    attn = units["layers.1.attn"]
    expected = layer.attn(h) - layer.attn.o.bias
    got = whole(attn, h, [2, 6], 8, [(layer.attn.qkv.weight, 0, (3, 4)), (layer.attn.o.weight, 1, (1, 4))])
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    # one call for several heads (count is an input): heads 2..4 at once == one at a time
    grid = torch.arange(96).view(3, 8, 4)
    rows = grid[:, 2:5, :].reshape(-1)
    several = attn["graph"](3, h, 2, 6, layer.attn.qkv.weight[rows], layer.attn.o.weight[:, grid[0, 2:5, :].reshape(-1)])
    one_by_one = sum(attn["graph"](1, h, 2, 6, layer.attn.qkv.weight[grid[:, u : u + 1, :].reshape(-1)],
                                   layer.attn.o.weight[:, grid[0, u : u + 1, :].reshape(-1)]) for u in (2, 3, 4))
    assert torch.allclose(several, one_by_one, atol=1e-12, rtol=0)
    # resize_tp routes every block's partial product through tp_units, before the all-reduce
    program = compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp", world_size=2, tp=2), (ids,))
    added = [n for n in program.graph.nodes if n.target is commfx.tp_units.default]
    assert len(added) == 4 and all(next(iter(n.users)).target is commfx.all_reduce.default for n in added)
    assert program.runtime.tp_resize["options"]["migrate"] == "units"


def test_unit_migration_plan_errors():
    model, inputs = load_model("gpt-moe-tiny")
    with pytest.raises(PlanError, match="migrate must be one of auto, units, columns"):
        compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp:migrate=rows", world_size=2, tp=2), inputs)
    with pytest.raises(PlanError, match=r"migrate=units needs the tp group to be the whole replica \(dp = pp = 1, got dp=2.*use migrate=columns"):
        compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp:migrate=units", world_size=4, tp=2), inputs)
    program = compile_program(model, Plan.from_cli("lift,tensor_parallel,resize_tp", world_size=4, tp=2), inputs)
    assert program.runtime.tp_resize["options"]["migrate"] == "columns"  # auto under tp x dp


def test_semi_migrates_the_share_that_balances_affine_times():
    """Rank 1 takes 0.05 s fixed + 0.3 s per shard, rank 0 0.02 + 0.1: balancing
    0.05 + 0.3 (1 - m) = 0.02 + 0.1 (1 + m) needs m = (0.35 - 0.12) / 0.4, not (r - 1) / (r + 1)."""
    state = SemiState(persistent=3, last_straggler=1)
    state.windows = [[[0.12, 0.35], [1.0, 1.0]], [[0.07, 0.2], [0.5, 0.5]]]
    d = _decide([0.12, 0.35], [1.0, 1.0], state, max_migrate=0.9)
    assert d.action == "migrate" and d.fraction == pytest.approx(0.23 / 0.4)


def _check_units(results, world_size):
    for result in results:
        assert result["mode"] == "units" and len(result["blocks"]) == 4
        assert result["plain_untouched"] == 0.0
        assert result["moved_bytes"] > 0
        assert result["migrated"] <= 1e-10  # outputs and every gradient (the taker's slot gradients summed back)
        assert result["migrated_general"] <= 1e-10  # given units beside resizing's index path
        assert result["records_match"] and result["records_kinds"] == ["tp_all_reduce"]  # no collective added per step
        assert result["undo_exact"] and result["slots_empty_after_undo"] and result["plans_plain_after_undo"]
        assert result["restored"] == 0.0
        assert result["training_diff"] <= 1e-10  # AdamW with units moved, moved again, moved back == AdamW
        assert result["slot_state_after_undo"] == 0  # the slots' optimizer state went back with them
        assert "does not hold resize_tp's unit slots" in result["unoptimized_slots_error"]
        assert result["layout_after_load"] == result["layout_saved"]  # which units are where survives state_dict
        assert result["load_diff"] == 0.0 and result["load_vs_reference"] <= 1e-10
        assert result["restored_at_end"] and result["restored_exact"] <= 1e-10
        # unit resizing (the last rank keeps half its units)
        assert result["unit_records_match"]  # every collective keeps its shape
        assert result["unit_resized"] <= 1e-10 and result["dropped_grads_zero"]  # == zeroed units; imputed zero
        assert result["unit_restore_exact"] and result["unit_load_diff"] == 0.0
        assert result["unit_kept_after_load"] == result["unit_kept"]
        assert result["unit_permuted_training_diff"] <= 1e-10
    last = results[-1]
    assert last["reordered"]  # some block's largest units were not its first: the shard was permuted
    assert last["kept_by_priority"] and last["unit_kept"] == {k: units // 2 for k, (units, _) in last["blocks"].items()}
    assert last["unit_resized_changes_output"] > 1e-3 and 0.0 < last["unit_error"] < 1.0
    assert all(r["unit_kept"] is None for r in results[:-1])
    # only the taker holds units; the same decisions and layouts on every rank
    assert any(size[0] for size in results[0]["slot_sizes"]) and not any(s[0] * s[-1] for r in results[1:] for s in r["slot_sizes"])
    assert all(r["decisions"] == results[0]["decisions"] and r["layouts"] == results[0]["layouts"] for r in results)
    assert results[0]["actions"][:2] == ["resize", "migrate"] and "restore" in results[0]["actions"]
    assert "units to rank" in results[0]["decisions"][1] and "moved once" in results[0]["decisions"][1]
    moved = [layout for layout in results[0]["layouts"] if layout]
    assert moved and all(layout["giver"] == world_size - 1 for layout in moved)


@pytest.mark.distributed
def test_unit_migration_at_tp2():
    _check_units(launch("resize_workers:unit_suite", 2, {}, timeout_s=300), 2)


@pytest.mark.distributed
@pytest.mark.slow
def test_unit_migration_at_tp4():
    _check_units(launch("resize_workers:unit_suite", 4, {}, timeout_s=300), 4)


@pytest.mark.slow
@pytest.mark.distributed
def test_unit_migration_on_hf_llama_grouped_query_attention_and_gated_mlp():
    """HF Llama: grouped-query attention (a unit is a kv group: one k/v head and the q heads
    that share it; rotary embeddings and the mask enter as outside inputs) and gated MLPs
    (gate and up, then down): moving all but one of the last rank's units to rank 0 is exact
    in float64, and moving them back is bit for bit."""
    results = launch("resize_workers:hf_unit_check", 2, {"spec": "hf:llama", "heads": 8, "kv_heads": 4}, timeout_s=300)
    for result in results:
        assert result["blocks"] == [f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.o_proj")]
        # per rank: 2 kv groups of (2 q heads, 1 k/v head), 8 blocks of 2 MLP columns
        assert result["moved"] == {f"model.layers.{i}.{m}.weight": n for i in (0, 1) for m, n in (("mlp.down_proj", 7), ("self_attn.o_proj", 1))}
        assert result["migrated"] <= 1e-10 and result["restored"] == 0.0
