"""commfx: a torch.fx compiler toolkit for distributed training communication."""

from .api import compile_program, distribute
from .checkpoint import CheckpointError, export_hf, load, save
from .backend import backend  # the function; the module stays importable as commfx.backend
from .compiler.pass_manager import check_plan
from .plan import PassSpec, Plan, PlanError, Topology
from .runtime.sharded_optimizer import shard_optimizer

__version__ = "0.1.0"
__all__ = ["CheckpointError", "export_hf", "load", "save", "PassSpec", "Plan", "PlanError", "Topology", "backend", "check_plan", "compile_program", "distribute", "shard_optimizer"]
