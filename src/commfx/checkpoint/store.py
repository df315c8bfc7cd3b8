"""Checkpoint directories: complete or absent, and checked before anything is read.

A checkpoint is written under a temporary name (`.step-000012.partial`), then the manifest
(`commfx.json`: the model's tensors, the plan, the step, each file's size and SHA-256) is
written into it, then it is renamed to `step-000012` and `latest` is pointed at it (written
aside and renamed too). A save that dies half way leaves only a `.partial` directory,
which is never loaded and is removed by the next save. Loading checks the manifest and
every file's digest first, so a truncated or altered file is named before DCP reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .state import CheckpointError

MANIFEST = "commfx.json"
FORMAT = "commfx-checkpoint/1"
LATEST = "latest"
REQUIRED = ("step", "form", "layout", "tensors", "files")  # what loading reads of a manifest


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{step_name(step)}.partial"


def clear_partials(root: Path) -> None:
    """Remove what saves that did not finish left behind."""
    for stale in root.glob(".step-*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def finish(root: Path, step: int, manifest: dict) -> Path:
    """Seal the partial directory of `step` with its manifest and rename it into place."""
    partial = partial_dir(root, step)
    files = sorted(p for p in partial.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {"format": FORMAT, **manifest, "files": {p.name: {"bytes": p.stat().st_size, "sha256": digest(p)} for p in files}}
    _write_atomically(partial / MANIFEST, json.dumps(manifest, indent=1))
    final = root / step_name(step)
    if final.exists():  # the same step saved again (a resumed run): the new one replaces it
        old = root / f".{step_name(step)}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(final)
    _write_atomically(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    return final


def _write_atomically(path: Path, text: str) -> None:
    aside = path.with_name(path.name + ".tmp")
    with open(aside, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(aside, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names: itself if it holds a manifest, else the one its `latest`
    names, else its highest complete `step-*`."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint {root} is a file, not a checkpoint directory (give the directory --checkpoint-dir wrote, or one step-* in it)")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} does not exist (give the directory --checkpoint-dir wrote, or one step-* in it)")
    if (root / MANIFEST).exists():
        return root
    latest = root / LATEST
    if latest.exists():
        named = root / latest.read_text().strip()
        if (named / MANIFEST).exists():
            return named
    complete = sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists())
    if complete:
        return complete[-1]
    partial = sorted(p.name for p in root.glob(".step-*.partial"))
    why = f" (only {', '.join(partial)}: saves that did not finish, which are never loaded)" if partial else ""
    raise CheckpointError(f"no complete checkpoint in {root}{why}; resume from a directory a finished save wrote")


def read_manifest(checkpoint: Path) -> dict:
    """The manifest, after checking every file it lists is there, whole and unchanged."""
    path = checkpoint / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read ({error}): the checkpoint is corrupted; resume from an earlier step-* directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path} is not a commfx checkpoint manifest (format {found!r}, expected {FORMAT!r})")
    missing = [key for key in REQUIRED if key not in manifest]
    if missing or not isinstance(manifest["files"], dict):
        what = f"has no {', '.join(repr(k) for k in missing)}" if missing else "lists its files wrongly"
        raise CheckpointError(f"{path} {what}: the manifest is damaged or was not written by commfx.save; resume from another step-* directory")
    for name, expected in manifest["files"].items():
        file = checkpoint / name
        if not file.exists():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; resume from an earlier step-* directory")
        size = file.stat().st_size
        if size != expected["bytes"] or digest(file) != expected["sha256"]:
            raise CheckpointError(
                f"{file} is corrupted ({size} bytes, SHA-256 differs from the manifest's {expected['bytes']} bytes); "
                "resume from an earlier step-* directory"
            )
    return manifest
