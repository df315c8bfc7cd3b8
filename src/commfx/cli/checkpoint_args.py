"""`commfx run`'s checkpoint options: --checkpoint-dir/--checkpoint-every, --resume, --export,
and --dtype (float64 runs compare every digit), checked before any rank starts."""

from __future__ import annotations

import argparse

from ..plan import PlanError
from .args import positive_int


def add_checkpoint_args(run: argparse.ArgumentParser) -> None:
    run.add_argument("--checkpoint-dir", metavar="DIR", help="save a checkpoint (commfx.save) here every --checkpoint-every steps")
    run.add_argument("--checkpoint-every", type=positive_int, default=0, metavar="N", help="steps between checkpoints (default: at the end)")
    run.add_argument("--resume", metavar="DIR", help="start from this checkpoint, or the latest complete one in this --checkpoint-dir")
    run.add_argument("--export", metavar="DIR", help="after the last step, write the whole model for transformers' from_pretrained (HF models)")
    run.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="the model's dtype (float64 to compare runs digit for digit)")


def check_checkpoint_args(args, model) -> None:
    """Options that cannot work fail here, each with what to do instead."""
    from ..checkpoint import store

    if args.checkpoint_every and not args.checkpoint_dir:
        raise PlanError("--checkpoint-every needs --checkpoint-dir DIR (where to save)")
    if args.resume:
        store.read_manifest(store.resolve(args.resume))  # incomplete, corrupted: refused before any rank starts
    if args.export and not hasattr(model, "save_pretrained"):
        raise PlanError(f"--export writes a transformers model for from_pretrained; {args.model} is not one (use an hf:<model_type> model)")
