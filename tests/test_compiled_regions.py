"""Compiled regions (Plan(compute="inductor")): where the cut falls, and that compiled
compute gives the interpreted graph's numbers.

The rest of the suite interprets (tests/conftest.py sets COMMFX_COMPUTE=interpret), so
each pass family runs through compiled regions here at least once, on small models: the
default run compiles expert parallelism with Lina's partitions in float64; the two `slow`
tests (minutes of compiling on 2 cores) compile the other families over gloo ranks.
"""

import copy
import dataclasses
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from commfx.compiler.compile_regions import REGION, cut_regions, default_hooks
from commfx.compiler.lower import compile_training, lower
from commfx.compiler.pipeline import compile_program
from commfx.compiler.sharding import shard_parameters
from commfx.models import load_model
from commfx.plan import Plan, PlanError
from commfx.runtime.comm import local_scheduler
from commfx.runtime.executor import BackwardExecutor, GraphExecutor, is_collective
from commfx.runtime.grad_sync import GradientSync, Slot
from commfx.runtime.launcher import launch
from commfx.verify import VerifyCase, verify

TESTS = Path(__file__).parent
LINA = "lift,expert_parallel,partition_a2a:k=2"


@pytest.fixture(scope="module")
def lina_world2():
    """gpt-moe under Lina's partitioned all-to-all at world 2, lowered (not compiled)."""
    model, inputs = load_model("gpt-moe", seed=0)
    return lower(compile_program(model, Plan.from_cli(LINA, world_size=2), inputs), inputs)


def _first_users(gm: fx.GraphModule, count: int) -> set[fx.Node]:
    params = [n for n in gm.graph.nodes if n.op == "placeholder"][:count]
    return {min(p.users, key=list(gm.graph.nodes).index) for p in params if p.users}


def test_regions_never_span_a_collective_and_end_at_every_hook(lina_world2):
    lowered = lina_world2
    for phase, gm in (("forward", lowered.forward), ("backward", lowered.backward)):
        hooks = default_hooks(gm, phase)
        if phase == "forward":  # a deferred parameter's first use starts a region
            hooks.before = _first_users(gm, 6)
        regions = cut_regions(gm, hooks)
        order = list(gm.graph.nodes)
        collectives = [n for n in order if is_collective(n)]
        assert len(collectives) >= 8 and regions
        for index, region in enumerate(regions):
            span = order[order.index(region[0]) : order.index(region[-1]) + 1]
            assert span == region, f"{phase} region {index} is not one contiguous run"
            assert not any(is_collective(n) for n in region)
            for node in region:
                assert node.meta[REGION] == index
        for node in collectives:
            assert REGION not in node.meta
        for node in hooks.before:
            region = regions[node.meta[REGION]]
            assert region[0] is node, f"{phase}: a region does not start at {node.name}"
        for node in hooks.after:
            region = regions[node.meta[REGION]]
            rest = region[region.index(node) + 1 :]  # only the getitems of the same tuple may follow
            assert all(r.target is operator.getitem and r.args[0] is node.args[0] for r in rest), (phase, node.name, rest)
        if phase == "backward":
            assert len(hooks.after) >= 10  # every gradient output


def test_a_region_hands_no_tuple_to_the_outer_graph(lina_world2):
    gm = lina_world2.backward
    for region in cut_regions(gm, default_hooks(gm, "backward")):
        inside = set(region)
        for node in region:
            if any(u not in inside for u in node.users):
                assert not isinstance(node.meta.get("val"), (tuple, list)), node.name


def _train_once(gm, inputs, compute: str):
    """Forward and backward of a lowered copy of `gm` on the world-of-one scheduler: loss,
    gradients, and the two graphs the executors ran."""
    scheduler = local_scheduler()
    params = list(gm.parameters())
    sync = GradientSync([Slot(f"p{i}", p, "dp") for i, p in enumerate(params)], scheduler, scale=1.0)
    graphs = {}

    def forward(g):
        graphs["forward"] = g
        return lambda *a: GraphExecutor(g, scheduler).run(*a)

    def backward(g):
        graphs["backward"] = g
        return lambda *a: BackwardExecutor(g, scheduler, sync).run(*a)

    run = compile_training(gm, inputs, forward=forward, backward=backward, compute=compute)
    for p in params:
        p.grad = None
    out = run(*inputs)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.sum().backward()
    return loss.detach(), [p.grad.clone() for p in params], graphs


def test_compiled_regions_equal_the_interpreted_graph_in_float64():
    model, inputs = load_model("gpt-moe", seed=0, dtype=torch.float64)
    program = compile_program(model, Plan.from_cli(LINA, world_size=1), inputs)
    shard_parameters(program, 0)
    want_loss, want_grads, plain = _train_once(copy.deepcopy(program.gm), inputs, "interpret")
    loss, grads, compiled = _train_once(copy.deepcopy(program.gm), inputs, "inductor")
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-10)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # the two layers' regions of the same code share their compiled code (compile_regions._COMPILED)
    modules = [m for phase in ("forward", "backward") for m in compiled[phase].modules() if hasattr(m, "compiled")]
    assert len({id(m.compiled) for m in modules}) < len(modules)
    for phase in ("forward", "backward"):
        gm, before = compiled[phase], plain[phase]
        regions = [n for n in gm.graph.nodes if n.op == "call_module"]
        report = gm.meta["commfx_regions"]
        assert len(regions) == len(report.sizes) >= 3, (phase, report)
        # a region whose input size is a sum of all-to-all sizes (partition_a2a's merged chunks
        # in backward) cannot be compiled (Inductor binds only plain symbols): the rest is
        assert report.failed_nodes <= 0.1 * sum(report.sizes), (phase, report.notes)
        assert all("to have been codegen-ed" in note for note in report.notes), report.notes
        # the collectives are the interpreted graph's, in its order; none went into a region
        assert [str(n.target) for n in gm.graph.nodes if is_collective(n)] == [str(n.target) for n in before.graph.nodes if is_collective(n)]
        for node in regions:
            assert not any(is_collective(n) for n in gm.get_submodule(node.target).graph_module.graph.nodes)
    # the expert ops were opened around their GEMMs (ops/decompositions.py) and the hidden
    # layer the backward used to recompute is the forward's, saved: per expert call, two
    # GEMMs forward and two backward (with the two weight gradients), not three
    forward_gemms, backward_gemms = (_targets(compiled[phase]) for phase in ("forward", "backward"))
    assert "expert_ffn" not in forward_gemms and "expert_ffn_backward" not in backward_gemms
    assert forward_gemms.count("grouped_mm") == 2 * plain["forward"].graph.find_nodes(op="call_function", target=torch.ops.commfx.expert_ffn.default).__len__() > 0
    assert backward_gemms.count("grouped_mm") == forward_gemms.count("grouped_mm")
    assert backward_gemms.count("grouped_mm_weight_grad") == forward_gemms.count("grouped_mm")


def _targets(gm: fx.GraphModule) -> list[str]:
    """Op names (commfx's, without namespace) in a graph and its compiled regions' graphs."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            names += _targets(gm.get_submodule(node.target).graph_module)
        elif node.op == "call_function" and str(node.target).startswith("commfx."):
            names.append(str(node.target).split(".")[1])
    return names


def test_interpret_is_a_plan_choice_and_a_bad_one_is_refused():
    assert Plan.from_cli("lift", world_size=1).compute == "interpret"  # tests/conftest.py's default
    with pytest.raises(PlanError, match="compute must be one of inductor, interpret"):
        dataclasses.replace(Plan.from_cli("lift", world_size=1), compute="jit").validate()


def test_dump_shows_the_regions(capsys):
    from commfx.cli.main import main

    assert main(["dump", "gpt-moe", "--world-size", "2", "--passes", LINA, "--stage", "backward", "--compute", "inductor"]) == 0
    text = capsys.readouterr().out
    assert "# ---- region 0 (" in text and "compiled by Inductor" in text
    lines = text.splitlines()
    for i, line in enumerate(lines):  # a collective is shown outside every region
        if "commfx.all_to_all_start(" in line or "commfx.wait_tensor(" in line:
            header = next(l for l in reversed(lines[:i]) if l.startswith("# ----"))
            assert header == "# ---- interpreted ----", (line, header)


def _inductor(case: VerifyCase) -> VerifyCase:
    return dataclasses.replace(case, plan=dataclasses.replace(case.plan, compute="inductor"))


@pytest.mark.slow
@pytest.mark.distributed
def test_pass_families_through_compiled_regions_equal_the_reference():
    """expert parallelism with Lina's partitions, packing and two-micro-batch overlap;
    tensor parallelism; a pipeline; EmbRace's sharded tables and vocabulary-parallel head:
    float64, world 2, every region compiled."""
    embedding_lm = f"{TESTS / 'model_files' / 'embedding_lm.py'}:build_loss_9"
    cases = [
        VerifyCase("gpt-moe", Plan.from_cli("lift,expert_parallel,pack_experts,partition_a2a:k=2,microbatch_overlap", world_size=2), batch=5),
        VerifyCase("gpt-moe-tiny", Plan.from_cli("lift,tensor_parallel", world_size=2, tp=2)),
        VerifyCase("gpt-moe", Plan.from_cli("lift,pipeline_split", world_size=2, pp=2), batch=4, seq=8),
        VerifyCase(embedding_lm, Plan.from_cli("lift,split_embedding_comm:strategy=shard;head=shard", world_size=2)),
    ]
    for report in verify([_inductor(c) for c in cases], 2, timeout_s=900):
        assert report.ok, (report.case.model, report.case.plan.pass_names(), report.failures, report.max_diff)
        assert report.grad_diffs


@pytest.mark.slow
@pytest.mark.distributed
def test_deferred_and_sharded_steps_through_compiled_regions(monkeypatch):
    """defer_grad_sync (a region starts at a deferred bucket's first use) and ZeRO-3 (at a
    bucket's first reader, ending at its last): steps equal the plain plan's, compiled."""
    sys.path.insert(0, str(TESTS))
    import test_defer_grad_sync

    monkeypatch.setenv("COMMFX_COMPUTE", "inductor")  # spawned ranks build their plans from it
    base = "lift,expert_parallel"
    results = launch("defer_workers:train_each_plan", 2, {"plans": [base, f"{base},defer_grad_sync"]}, timeout_s=900, collective_timeout_s=120)
    test_defer_grad_sync._check_equal(results, ((base, f"{base},defer_grad_sync"),))
    plans = ["lift", "lift,shard_states:stage=3"]
    results = launch("shard_workers:train_each_plan", 2, {"plans": plans, "bucket_bytes": 4096}, timeout_s=900, collective_timeout_s=120)
    for result in results:
        want, got = result["lift"], result["lift,shard_states:stage=3"]
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-10, msg=name)
