"""The pass registry. Importing this package registers every pass, in pipeline order."""

from . import lift, expert_parallel, partition_a2a  # noqa: F401  (registration side effects)
from .base import REGISTRY, Pass, PassError, get_pass, register, run_passes, verify_graph

__all__ = ["REGISTRY", "Pass", "PassError", "get_pass", "register", "run_passes", "verify_graph"]
