"""`commfx.export_hf`: the whole trained model as a transformers directory.

Every rank's shards are gathered into full tensors on rank 0, which writes them with the
model's own `save_pretrained` (its config, its tensor names, safetensors), so
`AutoModelForCausalLM.from_pretrained(DIR)` (or the model's class) loads it as if it had
been trained in one process. Written to a temporary directory and renamed, like checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .gather import gather_full
from .state import CheckpointError


def hf_model_of(dm):
    """The transformers model `dm` was distributed from (its skeleton: same class and config)."""
    root = getattr(dm.program, "modules", {}).get("")
    if root is None or not hasattr(root, "save_pretrained"):
        name = type(root).__name__ if root is not None else "this module"
        raise CheckpointError(f"export_hf writes transformers models; {name} is not one (save a checkpoint with commfx.save instead)")
    return root


def export_hf(dm, directory) -> Path:
    """Write `dm`'s full model to `directory` for `from_pretrained`. Collective: every rank
    calls it; rank 0 writes. Returns the directory."""
    model = hf_model_of(dm)
    full = gather_full(dm)
    target = Path(directory)
    if dm.scheduler.rank == 0:
        partial = target.with_name(f".{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=full)
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
    dm.scheduler.barrier()
    return target
