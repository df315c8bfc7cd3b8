"""`commfx.export_hf`: the whole trained model as a transformers directory.

Every rank's shards are gathered into full tensors on rank 0, which writes them with the
model's own `save_pretrained` (its config, its tensor names, safetensors), so
`AutoModelForCausalLM.from_pretrained(DIR)` (or the model's class) loads it as if it had
been trained in one process. Written to a new directory beside the target and renamed into
place. Nothing commfx did not write is ever deleted: a target that exists must be empty or
an earlier export (it holds `EXPORT_MARK`); anything else is refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .agree import agree
from .gather import gather_full
from .state import CheckpointError

EXPORT_MARK = "commfx-export.json"  # written into every export: what may be replaced by the next


def hf_model_of(dm):
    """The transformers model `dm` was distributed from (its skeleton: same class and config)."""
    root = getattr(dm.program, "modules", {}).get("")
    if root is None or not hasattr(root, "save_pretrained"):
        name = type(root).__name__ if root is not None else "this module"
        raise CheckpointError(f"export_hf writes transformers models; {name} is not one (save a checkpoint with commfx.save instead)")
    return root


def export_refusal(target: Path) -> str | None:
    """Why an export must not be written to `target`, or None: it is a file, or a directory
    holding something that is not an earlier export (which replacing would delete)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        return f"{target} is a file; give a directory for the export"
    if not target.is_dir():
        return None
    held = sorted(p.name for p in target.iterdir())
    foreign = [name for name in held if name not in _exported_files(target)]
    if not foreign:
        return None
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    what = "an earlier commfx export with files added" if (target / EXPORT_MARK).is_file() else "not an earlier commfx export"
    return (f"{target} holds {shown} and is {what}; an export replaces its target, so it goes to a new or empty directory "
            "or an earlier export (commfx never deletes files it did not write)")


def _exported_files(directory: Path) -> set[str]:
    """The names an earlier export wrote into `directory` (none if it is not an export)."""
    try:
        mark = json.loads((directory / EXPORT_MARK).read_text())
        return {EXPORT_MARK, *mark["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def export_hf(dm, directory) -> Path:
    """Write `dm`'s full model to `directory` for `from_pretrained`. Collective: every rank
    calls it; rank 0 writes, and a failure there raises on every rank. Returns the directory."""
    model = hf_model_of(dm)
    full = gather_full(dm)
    target = Path(directory).absolute()

    def write() -> None:
        refusal = export_refusal(target)
        if refusal:
            raise CheckpointError(refusal)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
        try:
            model.save_pretrained(partial, state_dict=full)
            files = sorted(p.name for p in partial.iterdir())
            mark = {"format": "commfx-export/1", "model": type(model).__name__, "files": files}
            (partial / EXPORT_MARK).write_text(json.dumps(mark) + "\n")
            _replace(target, partial)
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # gone already unless the write failed

    agree(dm.scheduler, f"exporting the model to {target}", write, on_rank=0)
    return target


def _replace(target: Path, new: Path) -> None:
    """Rename `new` to `target`; an empty directory or an earlier export there is moved aside
    first and removed only once the new export is in place."""
    if not target.exists():
        new.rename(target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    aside.rmdir()
    target.rename(aside)
    new.rename(target)
    shutil.rmtree(aside)
