"""The pass registry. Importing this package registers every pass, in pipeline order."""

from . import lift, expert_parallel, locality_gate, partition_a2a, pack_experts, hierarchical_a2a, split_embedding_comm, pipeline_split, compress_pipeline, tensor_parallel, resize_tp, microbatch_overlap, defer_grad_sync, shard_states  # noqa: F401  (registration side effects)
from .base import REGISTRY, Pass, PassError, get_pass, plan_options, register

__all__ = ["REGISTRY", "Pass", "PassError", "get_pass", "plan_options", "register"]
