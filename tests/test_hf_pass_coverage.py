"""Every pass of the README's table on ranks, on Hugging Face models as transformers builds
them, in the default run: lossless plans at 1e-10 against the float64 single-process model
(verify, which also fails a pass that changed nothing), and each case's rewrite counted.

compress_pipeline is lossy in general; at a factor rank equal to the boundary's hidden size
PowerSGD reconstructs the gradient exactly, so it is held to 1e-10 there. locality_gate (lossy)
runs on ranks on an HF model in test_multinode.py; defer_grad_sync on an HF model in
test_defer_grad_sync.py (it needs optimizer steps to compare).
"""

import pytest

from commfx.plan import Plan
from commfx.verify import VerifyCase, verify

pytestmark = pytest.mark.distributed

# model, passes, topology, rewrites that must be counted: {pass: {what: at least}}
CASES = [
    (
        "hf:qwen3_moe",
        "lift,expert_parallel,pack_experts,partition_a2a:k=2,microbatch_overlap",
        {},
        {"pack_experts": {"commfx.rank_dispatch": 2}, "partition_a2a": {"commfx.split_chunks": 2}, "microbatch_overlap": {"tensor_split": 1}},
    ),
    ("hf:olmoe", "lift,expert_parallel,split_embedding_comm:strategy=sparse", {}, {"split_embedding_comm": {"sparse tables": 1}}),
    ("hf:qwen2_moe", "lift,expert_parallel,hierarchical_a2a", {"ranks_per_node": 1}, {"hierarchical_a2a": {"a2a_algorithm: hierarchical": 1}}),
    (
        "hf:mixtral",
        "lift,pipeline_split:microbatches=2,compress_pipeline:rank=32;epilogue_only=false",
        {"pp": 2},
        {"pipeline_split": {"stages": 2}, "compress_pipeline": {"boundary codecs": 1}},
    ),
    ("hf:llama", "lift,tensor_parallel,resize_tp", {"tp": 2}, {"tensor_parallel": {"commfx.all_reduce": 4}, "resize_tp": {"commfx.tp_linear": 8}}),
]


def test_every_pass_runs_on_ranks_on_an_hf_model():
    cases = [VerifyCase(model, Plan.from_cli(passes, world_size=2, **topology)) for model, passes, topology, _ in CASES]
    reports = verify(cases, 2, timeout_s=600)
    for report, (model, passes, _, expected) in zip(reports, CASES):
        assert report.ok, (model, passes, report.failures, report.max_diff)
        assert report.grad_diffs, (model, "no gradient compared")
        for name, counts in expected.items():
            for what, least in counts.items():
                assert report.rewrites[name].get(what, 0) >= least, (model, name, report.rewrites[name])
