"""pack_experts: each token goes to each rank once; lossless against the model in float64."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commfx.ops  # noqa: F401
from commfx.compiler.pass_manager import check_plan
from commfx.plan import Plan, PlanError
from commfx.verify import VerifyCase, verify

commfx_ops = torch.ops.commfx
MODEL_FILES = Path(__file__).parent / "model_files"
PACKED = "lift,expert_parallel,pack_experts"


def simulate(x, indices, weights, ranks, local_experts, expert_scale, slot_of=None, capacity_factor=0.0):
    """The packed block in one process: the all-to-alls are slices of the dispatched rows.
    Expert e multiplies its rows by expert_scale[e] (a stand-in FFN linear in its input) and
    lives in slot slot_of[e] (rank slot // local_experts)."""
    experts = ranks * local_experts
    slot_of = torch.arange(experts) if slot_of is None else slot_of
    expert_in_slot = torch.empty_like(slot_of)
    expert_in_slot[slot_of] = torch.arange(experts)
    rows, meta, row_token, send = commfx_ops.rank_dispatch(x, slot_of[indices], weights, ranks, local_experts, capacity_factor)
    pieces = []
    payload = commfx_ops.attach_meta(rows, meta)  # what the dispatch all-to-all carries
    for rank, r_payload in enumerate(payload.split(send.tolist())):
        r_rows, row_weights, local_ids = commfx_ops.detach_meta(r_payload, meta)
        laid, counts, slot = commfx_ops.masked_dispatch(r_rows, local_ids, local_experts)
        here = expert_in_slot[rank * local_experts : (rank + 1) * local_experts]
        scale = expert_scale[here].repeat_interleave(counts)
        pieces.append(commfx_ops.moe_combine(laid * scale.unsqueeze(1), slot, row_weights))
    return commfx_ops.scatter_add_tokens(torch.cat(pieces), row_token, x), send


@pytest.mark.parametrize(
    "rows_dtype, meta_dtype, k",
    [(torch.float64, torch.float64, 2), (torch.float16, torch.float32, 2), (torch.bfloat16, torch.float32, 1),
     (torch.float16, torch.float64, 1), (torch.float64, torch.float16, 3)],
)
def test_routing_metadata_rides_in_the_rows_bit_for_bit(rows_dtype, meta_dtype, k):
    """attach_meta/detach_meta carry weights and ids as extra columns of the rows, whatever
    the two dtypes (padded where the bytes do not fill a column): values and both gradients
    come back exactly, ids included, and a row count of 0 works."""
    generator = torch.Generator().manual_seed(k)
    for count in (5, 0):
        rows = torch.randn(count, 3, generator=generator).to(rows_dtype).requires_grad_()
        weights = torch.rand(count, k, generator=generator).to(meta_dtype).requires_grad_()
        ids = torch.randint(-1, 7, (count, k), generator=generator)
        meta = torch.cat([weights, ids.to(meta_dtype)], dim=1)
        payload = commfx_ops.attach_meta(rows, meta)
        assert payload.dtype == rows_dtype and payload.shape[0] == count
        back_rows, back_weights, back_ids = commfx_ops.detach_meta(payload, meta)
        assert torch.equal(back_rows, rows) and torch.equal(back_weights, weights) and torch.equal(back_ids, ids)
        grad_rows = torch.randn(count, 3, generator=generator).to(rows_dtype)
        grad_weights = torch.randn(count, k, generator=generator).to(meta_dtype)
        torch.autograd.backward([back_rows, back_weights], [grad_rows, grad_weights])
        assert torch.equal(rows.grad, grad_rows) and torch.equal(weights.grad, grad_weights)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 9),
    ranks=st.sampled_from([1, 2, 4]),
    local_experts=st.integers(1, 3),
    k=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    capacity_factor=st.sampled_from([0.0, 0.5, 1.0]),
    placed=st.booleans(),
)
def test_rows_are_the_unique_token_rank_pairs_and_the_sum_is_exact(tokens, ranks, local_experts, k, seed, capacity_factor, placed):
    """Any placement, dropless or capacity: rows = unique (token, rank) pairs of the kept
    assignments, and the sum and its gradients are the plain formula's."""
    experts = ranks * local_experts
    k = min(k, experts)
    generator = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    x = torch.randn(tokens, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weights = torch.rand(tokens, k, dtype=torch.float64, generator=generator, requires_grad=True)
    scale = torch.rand(experts, dtype=torch.float64, generator=generator) + 0.5
    slot_of = torch.randperm(experts, generator=generator) if placed else torch.arange(experts)
    out, send = simulate(x, indices, weights, ranks, local_experts, scale, slot_of, capacity_factor)
    # What moe_dispatch keeps (slot >= 0) is what the packed rows carry.
    kept = (commfx_ops.moe_dispatch(x.detach(), indices, experts, capacity_factor)[2] >= 0).view(tokens, k)
    owners = slot_of[indices] // local_experts
    assert int(send.sum()) == sum(len(set(row[keep].tolist())) for row, keep in zip(owners, kept))  # the minimum
    expected = (kept.unsqueeze(-1) * weights.unsqueeze(-1) * scale[indices].unsqueeze(-1) * x.unsqueeze(1)).sum(1)
    assert (out - expected).abs().max() <= 1e-12
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (x, weights))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (x, weights))
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_the_fused_packed_experts_equal_the_unfused_ops_with_gradients(activation):
    """packed_expert_ffn == masked_dispatch -> expert_ffn -> moe_combine in float64, and so
    are the gradients of x, the routing weights and both expert weights (rows with no
    local expert, an expert with no rows)."""
    generator = torch.Generator().manual_seed(7)
    rows, k, experts, hidden, inner = 9, 3, 4, 5, 3
    local_ids = torch.randint(-1, experts - 1, (rows, k), generator=generator)  # expert 3 never chosen
    local_ids[2] = -1
    x = torch.randn(rows, hidden, dtype=torch.float64, generator=generator, requires_grad=True)
    weights = torch.rand(rows, k, dtype=torch.float64, generator=generator, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inner, hidden, dtype=torch.float64, generator=generator, requires_grad=True)
    down = torch.randn(experts, hidden, inner, dtype=torch.float64, generator=generator, requires_grad=True)
    fused = commfx_ops.packed_expert_ffn(x, local_ids, weights, gate_up, down, activation)
    laid, counts, slot = commfx_ops.masked_dispatch(x, local_ids, experts)
    unfused = commfx_ops.moe_combine(commfx_ops.expert_ffn(laid, counts, gate_up, down, activation), slot, weights * (local_ids >= 0))
    assert (fused - unfused).abs().max() <= 1e-12 and torch.count_nonzero(fused[2]) == 0
    probe = torch.randn_like(fused)
    inputs = (x, weights, gate_up, down)
    for got, want in zip(torch.autograd.grad((fused * probe).sum(), inputs), torch.autograd.grad((unfused * probe).sum(), inputs)):
        assert (got - want).abs().max() <= 1e-12


def packed_cases(subset: str) -> list[VerifyCase]:
    plan = Plan.from_cli(PACKED, world_size=2)
    chunked = Plan.from_cli(PACKED + ",partition_a2a:k=2", world_size=2)
    capacity = Plan.from_cli("lift,expert_parallel:capacity_factor=1.0,pack_experts", world_size=2)
    capacity_chunked = Plan.from_cli("lift,expert_parallel:capacity_factor=0.75,pack_experts,partition_a2a:k=3", world_size=2)
    if subset == "default":
        return [
            VerifyCase(f"{MODEL_FILES / 'routing.py'}:top1", chunked),
            VerifyCase("gpt-moe", plan, batch=3),
            VerifyCase(f"{MODEL_FILES / 'routing.py'}:rank0_starved", chunked),
            VerifyCase(f"{MODEL_FILES / 'routing.py'}:top4", capacity_chunked),
        ]
    return [
        VerifyCase(f"{MODEL_FILES / 'routing.py'}:top4", chunked),
        VerifyCase("hf:mixtral", plan, batch=3),
        VerifyCase("gpt-moe", capacity, batch=3),
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("subset", ["default", pytest.param("more", marks=pytest.mark.slow)])
def test_packed_expert_parallel_equals_the_model(subset):
    """World 2: top-1, top-2 (uneven batch) and top-4, a rank that receives no token rows at
    all, capacity mode, each with partition_a2a after packing; HF Mixtral, top-4 and
    capacity without chunks under `make test-all`. Outputs and every gradient (router
    weights included) <= 1e-10."""
    cases = packed_cases(subset)
    for case, report in zip(cases, verify(cases, 2, timeout_s=600)):
        assert report.ok, (case.model, report.failures, report.max_diff)
        assert any("router" in name or "gate" in name for name in report.grad_diffs), "router gradients are compared"


@pytest.mark.distributed
@pytest.mark.slow
def test_packed_expert_parallel_with_and_without_chunks_equals_the_model_at_world_4():
    """The world-2 cases above at world 4 (more devices holding a packed expert): a heavier
    duplicate, under `make test-all`."""
    cases = [
        VerifyCase("gpt-moe", Plan.from_cli(PACKED, world_size=4), batch=5),
        VerifyCase("gpt-moe", Plan.from_cli(PACKED + ",partition_a2a:k=2", world_size=4), batch=6),
    ]
    for case, report in zip(cases, verify(cases, 4, timeout_s=600)):
        assert report.ok, (case.plan, report.failures, report.max_diff)


@pytest.mark.slow
@pytest.mark.distributed
def test_packing_sends_fewer_rows_than_plain_expert_parallel():
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    plain, packed = (launch("dist_workers:dispatch_rows", 2, {"passes": p}, timeout_s=300) for p in ("lift,expert_parallel", PACKED))
    for plain_rank, packed_rank in zip(plain, packed):
        assert plain_rank["tokens"] == packed_rank["tokens"]
        # Plain: one row per (token, expert); packed: one per (token, rank), the unique minimum.
        assert plain_rank["dispatch_rows"] == 2 * plain_rank["tokens"] * 2  # 2 layers x tokens x top-2
        assert packed_rank["dispatch_rows"] == packed_rank["unique_token_rank_pairs"] < plain_rank["dispatch_rows"]


@pytest.mark.parametrize(
    "passes, message",
    [
        ("lift,pack_experts", "needs expert_parallel before it; for example --passes lift,expert_parallel,pack_experts"),
        (
            "lift,expert_parallel,partition_a2a,pack_experts",
            "pack_experts must come before partition_a2a (partition_a2a chunks the packed exchange); "
            "for example --passes lift,expert_parallel,pack_experts,partition_a2a",
        ),
        ("lift,expert_parallel,pack_experts:replace_every=-1", "replace_every must be >= 0"),
        ("lift,expert_parallel,pack_experts:balance=-0.5", "balance must be >= 0"),
        ("lift,expert_parallel,pack_experts:payback=-1", "payback must be >= 0 (steps within which a move's saved all-to-all bytes"),
        ("lift,expert_parallel,pack_experts:degree=0", "degree must be >= 1 (experts per device), got 0"),
        ("lift,expert_parallel,pack_experts:degree=many", "degree must be an integer >= 1 (experts per device) or 'auto'"),
    ],
)
def test_plans_pack_experts_cannot_run_are_clear_errors(passes, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_plan(Plan.from_cli(passes, world_size=2))


@pytest.mark.distributed
def test_a_run_that_re_places_experts_equals_one_that_never_did_and_resumes_from_its_checkpoint():
    """float64, Adam, world 2: re-placing every 2 steps (weights and Adam moments moved) gives
    the losses and parameters of a run that never re-places; a module and optimizer saved
    after step 3 (placement and statistics in the state_dict) resume into a fresh module
    and finish the run identically."""
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    for rank in launch("pack_workers:replacement_equivalence", 2, timeout_s=300):
        never, moved = rank["never"], rank["moved"]
        assert sum(moved["moved"][0]) > 0, "the first re-placement moved experts (else this proves nothing)"
        assert any(after > before for before, after in moved["colocated"][0]), "it placed co-selected experts together"
        assert any(s != sorted(s) for s in moved["slot_of"].values())
        assert max(abs(a - b) for a, b in zip(never["losses"], moved["losses"])) <= 1e-10
        for name, weight in never["experts"].items():
            assert (weight - moved["experts"][name]).abs().max() <= 1e-10, name
        for name, weight in never["others"].items():
            assert (weight - moved["others"][name]).abs().max() <= 1e-10, name
        # The checkpoint: the placement and statistics came back, and the rest of the run is the same.
        assert moved["restored_stats"] == moved["saved_stats"] and all(v > 0 for v in moved["saved_stats"].values())
        assert moved["resumed_slot_of"] == moved["slot_of"]
        assert moved["resumed_losses"] == moved["losses"]
        for name, weight in moved["experts"].items():
            assert torch.equal(weight, moved["resumed_experts"][name]), name
        # payback=0: the same better placements are found, declined (their moves cost bytes), nothing moves.
        declined = rank["declined"]
        first = [(count > 0, repay) for count, (_, repay) in zip(moved["moved"][0], moved["declined"][0])]
        assert declined["declined"][0] == first, (declined["declined"], moved["declined"])
        assert all(repay > 0 for was_declined, repay in first if was_declined) and sum(map(sum, declined["moved"])) == 0
        assert all(s == sorted(s) for s in declined["slot_of"].values())
        assert max(abs(a - b) for a, b in zip(never["losses"], declined["losses"])) <= 1e-10


def test_replacement_under_deferred_sync_leaves_other_gradients_on_the_wire():
    """defer_grad_sync's gradients keep flying into the next forward across a re-placement
    (it settles only the experts it moves), and the run equals one that never re-places
    (float64, world 2)."""
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    for rank in launch("pack_workers:replacement_with_deferred_sync", 2, timeout_s=300):
        never, moved = rank["never"], rank["moved"]
        assert sum(sum(m) for m in moved["moved"]) > 0, "a re-placement moved experts (else this proves nothing)"
        assert all(moved["pending_after_replacement"]), "gradients other than the experts' were settled by the re-placement"
        assert max(abs(a - b) for a, b in zip(never["losses"], moved["losses"])) <= 1e-10
        for name, weight in never["experts"].items():
            assert (weight - moved["experts"][name]).abs().max() <= 1e-10, name
        for name, weight in never["others"].items():
            assert (weight - moved["others"][name]).abs().max() <= 1e-10, name


@pytest.mark.parametrize(
    "degree, message",
    [
        (3, "degree=3 does not fit: 8 experts in groups of 3 need an expert-parallel group of 2.66667 ranks, which must "
            "divide the world size 2; degrees that fit: [4, 8]"),
        (8, "degree=8 means an expert-parallel group of 1 ranks, but the plan has ep=2 (4 experts per device); pass --ep 1 (or degree=4)"),
    ],
)
def test_degrees_that_do_not_fit_the_model_are_clear_errors(degree, message):
    from commfx.models import load_model

    model, _ = load_model("gpt-moe")
    with pytest.raises(PlanError, match=re.escape(message)):
        check_plan(Plan.from_cli(f"{PACKED}:degree={degree}", world_size=2), model)
    check_plan(Plan.from_cli(f"{PACKED}:degree=4", world_size=2), model)  # 8 experts over ep=2: fits


def test_the_cost_model_packs_more_experts_per_device_when_the_all_to_all_outlasts_one_experts_compute():
    """16 ranks, 8 per node, 16 experts. At one expert per device the all-to-all crosses nodes and
    outlasts the compute; two per device keep it inside a node, where the compute covers it.
    With compute 100x slower, one per device is covered already, and packing is not worth it."""
    from commfx.cost.moe import MoERegion, packing_degree
    from commfx.plan import Topology

    region = MoERegion(tokens=512, hidden=1024, expert_hidden=2048, top_k=2, num_experts=16, dtype_bytes=2)
    fast = packing_degree(region, Topology(16, ranks_per_node=8), chunks=2)
    assert fast.degree == 2 and fast.a2a_s[1] > fast.compute_s >= fast.a2a_s[2]
    assert "expert-parallel group of 8" in fast.reason
    slow = packing_degree(region, Topology(16, ranks_per_node=8, flops_per_s=1e12), chunks=2)
    assert slow.degree == 1 and slow.a2a_s[1] <= slow.compute_s


def test_dump_says_what_packing_degree_it_chose_and_why(capsys):
    from commfx.cli.main import main

    assert main(["dump", "gpt-moe-tiny", "--world-size", "2", "--passes", PACKED]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("# pack_experts layers.0.moe.experts: 2 experts per device (ep=2, degree=auto). Cost model recommends")
    assert "all-to-all" in header and "expert(s) per device" in header


@pytest.mark.slow
@pytest.mark.distributed
def test_commfx_run_re_places_experts_and_still_trains_pipelines(capsys, tmp_path):
    """`commfx run` attaches the optimizer for re-placement: experts really move (the JSON's
    placement), and since moving is lossless the losses are the run's without re-placement
    (float32, to rounding). A pipelined module (which has no packed experts) trains as before."""
    import json
    import math

    from commfx.cli.main import main

    runs = {}
    for label, passes in (("moved", f"{PACKED}:replace_every=1;balance=0.5"), ("fixed", PACKED)):
        out = tmp_path / f"{label}.json"
        assert main(["run", "gpt-moe", "--world-size", "2", "--steps", "3", "--passes", passes, "--json", str(out)]) == 0
        runs[label] = json.loads(out.read_text())
    placements = runs["moved"]["expert_placement"].values()
    assert any(p["replacements"] >= 1 and p["slot_of"] != sorted(p["slot_of"]) for p in placements), placements
    moved, fixed = ([h["loss"] for h in runs[label]["history"]] for label in ("moved", "fixed"))
    assert all(math.isfinite(loss) for loss in moved) and moved[-1] < moved[0], moved
    assert moved == pytest.approx(fixed, rel=1e-5), (moved, fixed)
    assert main(["run", "gpt-moe", "--world-size", "2", "--pp", "2", "--steps", "2", "--passes", "lift,pipeline_split"]) == 0
    assert capsys.readouterr().out.count("done in") == 3
