"""The pass registry. Importing this package registers every pass, in pipeline order."""

from . import lift, expert_parallel, partition_a2a, pack_experts, split_embedding_comm  # noqa: F401  (registration side effects)
from .base import REGISTRY, Pass, PassError, check_plan, get_pass, plan_options, register, run_passes, verify_graph

__all__ = ["REGISTRY", "Pass", "PassError", "check_plan", "get_pass", "plan_options", "register", "run_passes", "verify_graph"]
