"""microbatch_overlap: micro-batches interleaved by all-to-all phase; lossless in float64."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from commfx.api import compile_program
from commfx.models import build_gpt_moe, load_model
from commfx.compiler.pass_manager import check_plan
from commfx.passes import PassError
from commfx.plan import Plan, PlanError
from commfx.verify import VerifyCase, verify
from test_golden import check_golden, rendered

MODEL_FILES = Path(__file__).parent / "model_files"
PACKED_K2 = "lift,expert_parallel,pack_experts,partition_a2a:k=2"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_interleaved_micro_batches_equal_the_model(world):
    """Plain expert parallelism, packed and chunked, top-1 and a rank that receives no rows,
    2 and 3 micro-batches, uneven micro-batches (3 sequences in 2) and an empty one (2 in 3):
    outputs and every gradient, router weights included, <= 1e-10."""
    def plan(passes):
        return Plan.from_cli(passes, world_size=world)

    cases = [
        VerifyCase("gpt-moe", plan("lift,expert_parallel,microbatch_overlap"), batch=2 * world + 1),
        VerifyCase("gpt-moe", plan(PACKED_K2 + ",microbatch_overlap:n=3"), batch=2 * world),
    ]
    if world == 2:  # these models' batches (5 and 4 sequences) give every rank >= 2 only at world 2
        cases += [
            VerifyCase(f"{MODEL_FILES / 'routing.py'}:top1", plan("lift,expert_parallel,partition_a2a:k=2,microbatch_overlap")),
            VerifyCase(f"{MODEL_FILES / 'routing.py'}:rank0_starved", plan(PACKED_K2 + ",microbatch_overlap")),
        ]
    for case, report in zip(cases, verify(cases, world, timeout_s=600)):
        assert report.ok, (case.model, case.plan, report.failures, report.max_diff)
        assert any("router" in name for name in report.grad_diffs), "router gradients are compared"


def test_tensor_parallel_all_reduces_are_copied_per_micro_batch():
    """tp x ep: each micro-batch's tp_copy and row-parallel all-reduce in its own turn, on `tp`."""
    model, inputs = load_model("gpt-moe-tiny")
    program = compile_program(model, Plan.from_cli("lift,expert_parallel,tensor_parallel,microbatch_overlap", world_size=2, tp=2), inputs)
    tp_ops = [n for n in program.graph.nodes if n.target in (torch.ops.commfx.tp_copy.default, torch.ops.commfx.all_reduce.default)]
    assert [n.target._opname for n in tp_ops] == ["tp_copy", "all_reduce"] * 2  # micro-batch 0's attention, then 1's
    assert {n.args[1] for n in tp_ops} == {"tp"}


@pytest.mark.distributed
@pytest.mark.slow
def test_interleaved_micro_batches_with_tensor_parallel_equal_the_model():
    plan = Plan.from_cli("lift,expert_parallel,tensor_parallel,microbatch_overlap", world_size=2, tp=2)
    (report,) = verify([VerifyCase("gpt-moe", plan)], 2, timeout_s=600)
    assert report.ok, (report.failures, report.max_diff)


def _positions(text: str, pattern: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines()) if re.search(pattern, line)]


def test_golden_interleaved_graphs():
    """Packed, k=2, two micro-batches: micro-batch 1's dispatch is on the wire before
    micro-batch 2's attention runs, and micro-batch 2's combine before micro-batch 1's head;
    in backward, each micro-batch's all-to-all starts before the other's expert backward.
    Count exchanges ride the 'ctl' lane."""
    texts = rendered("gpt-moe-tiny", PACKED_K2 + ",microbatch_overlap")
    check_golden(texts, "gpt-moe-tiny.ep4.packed-k2-mb2", ("distributed", "forward", "backward"))
    forward, backward = texts["forward"], texts["backward"]
    first_dispatch = _positions(forward, r"all_to_all_start\(.*dispatch 1/2 mb 1/2")[0]
    attention = _positions(forward, r"= aten\._scaled_dot_product")
    assert len(attention) == 2 and attention[0] < first_dispatch < attention[1]
    last_combine = _positions(forward, r"all_to_all_start\(.*combine 2/2 mb 2/2")[0]
    norms = _positions(forward, r"= aten\.native_layer_norm\(")  # per micro-batch: attention, MoE; then the final norms
    assert len(norms) == 6 and last_combine < norms[4]
    # backward: micro-batch 2 first (reverse creation order), interleaved per phase
    combine_bw = [_positions(backward, rf"all_to_all_start\(.*combine ./2 mb {m}/2 \(bw\)")[0] for m in (2, 1)]
    expert_bw = _positions(backward, r"packed_expert_ffn_backward\(")
    assert len(expert_bw) == 4 and combine_bw[0] < combine_bw[1] < expert_bw[0]
    assert texts["distributed"].count("'ctl')") == 2
    assert texts["distributed"].count("torch.cat(") == 1


@pytest.mark.parametrize(
    "passes, message",
    [
        ("lift,microbatch_overlap", "needs expert_parallel before it"),
        ("lift,expert_parallel,microbatch_overlap:n=1", "n must be >= 2 (micro-batches per rank), got 1"),
        ("lift,expert_parallel,microbatch_overlap:n=3,partition_a2a:k=2",
         "partition_a2a must come before microbatch_overlap (microbatch_overlap copies the graph per micro-batch, so it "
         "comes last); for example --passes lift,expert_parallel,partition_a2a:k=2,microbatch_overlap:n=3"),
        ("lift,expert_parallel:capacity_factor=1.0,microbatch_overlap", "capacity is counted per micro-batch"),
        ("lift,pipeline_split,expert_parallel,microbatch_overlap", "does not work with pipeline_split yet"),
    ],
)
def test_plans_microbatch_overlap_cannot_run_are_clear_errors(passes, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        check_plan(Plan.from_cli(passes, world_size=2, pp=2 if "pipeline" in passes else 1))


class ReturnsItsLoss(torch.nn.Module):
    """gpt-moe that returns the mean of its logits: a reduction over the whole batch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids).float().pow(2).mean()


def test_a_batch_of_one_sequence_is_a_clear_error():
    model, inputs = build_gpt_moe(batch=1)
    with pytest.raises(PassError, match="this rank's batch is 1 sequence"):
        compile_program(model, Plan.from_cli("lift,expert_parallel,microbatch_overlap", world_size=2), inputs)


def test_a_model_that_reduces_over_the_batch_is_a_clear_error():
    model, inputs = build_gpt_moe(batch=4)
    with pytest.raises(PassError, match="reduction over the whole batch that micro-batches would compute apart"):
        compile_program(ReturnsItsLoss(model), Plan.from_cli("lift,expert_parallel,microbatch_overlap", world_size=2), inputs)



@pytest.mark.parametrize("model_name", ["gpt-moe", pytest.param("hf:olmoe", marks=pytest.mark.slow)])
def test_torch_compile_door_with_the_batch_marked_dynamic_equals_eager(model_name):
    """torch.compile(model, backend=commfx.backend(plan)) with microbatch_overlap, the batch
    dimension marked dynamic: the pass ran on the MoE graph, and the logits and every gradient
    equal eager in float64. Without the mark the batch is a constant, and the error says what to do."""
    import copy

    import commfx
    from commfx.models import load_model
    from commfx.models.hf import choose_experts_implementation

    model, (ids,) = load_model(model_name, dtype=torch.float64, batch=4)
    choose_experts_implementation(model)
    eager = copy.deepcopy(model)
    plan = Plan.from_cli("lift,expert_parallel,microbatch_overlap", world_size=1)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape("torch._dynamo.mark_dynamic(input_ids, 0)")):
        torch.compile(copy.deepcopy(model), backend=commfx.backend(plan))(input_ids=ids)

    def logits(output):
        return output if isinstance(output, torch.Tensor) else output.logits

    torch._dynamo.reset()
    marked = ids.clone()
    torch._dynamo.mark_dynamic(marked, 0)
    backend = commfx.backend(plan)
    got = logits(torch.compile(model, backend=backend)(input_ids=marked))
    want = logits(eager(input_ids=ids))
    assert any("microbatch_overlap: changed" in line for program in backend.programs for line in program.history)
    assert (got - want).abs().max() <= 1e-10
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-10, name


def test_partition_k_auto_sizes_chunks_for_one_micro_batch():
    """k=auto before microbatch_overlap:n=2 chooses the k for half the tokens: on the bench's
    link (100 Mbit/s, 5 ms per collective) 4 chunks for a whole rank's 1,024 tokens, 2 for
    one micro-batch's 512 (RESULTS 5e's tuned choice)."""
    from commfx.compiler.capture import capture
    from commfx.cost.moe import MoERegion, choose_chunks

    model, inputs = build_gpt_moe(batch=16, seq=64, max_seq=64, hidden_size=128, num_experts=8, expert_hidden=1024)
    topology = dict(ranks_per_node=1, inter_node_bandwidth=100e6 / 8, collective_overhead_s=5e-3, flops_per_s=2e10)
    chunks = {}
    captured = capture(model, inputs)  # one trace, two plans
    for passes in ("lift,expert_parallel,partition_a2a", "lift,expert_parallel,partition_a2a,microbatch_overlap"):
        program = compile_program(model, Plan.from_cli(passes, world_size=2, **topology), inputs, captured=captured)  # one rank's 16 sequences
        chunks[passes] = {block.chunks for block in program.regions.moe_blocks}
    tokens = 16 * 64
    region = dict(hidden=128, expert_hidden=1024, top_k=2, num_experts=8, dtype_bytes=4, matrices=3)
    plan = Plan.from_cli("lift", world_size=2, **topology)
    whole = choose_chunks(MoERegion(tokens=tokens, **region), plan.topology, chunk_overhead_s=1e-3)
    half = choose_chunks(MoERegion(tokens=tokens // 2, **region), plan.topology, chunk_overhead_s=1e-3)
    assert (whole, half) == (4, 2)
    assert chunks == {"lift,expert_parallel,partition_a2a": {whole}, "lift,expert_parallel,partition_a2a,microbatch_overlap": {half}}
