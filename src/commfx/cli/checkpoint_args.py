"""`commfx run`'s checkpoint options: --checkpoint-dir/--checkpoint-every, --resume, --export,
and --dtype (float64 runs compare every digit), checked before any rank starts.

Nothing the user owns is deleted or overwritten: an export goes only to a new or empty
directory or an earlier export, and never where checkpoints or other outputs are written."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..plan import PlanError
from .args import positive_int
from .checks import check_directory


def add_checkpoint_args(run: argparse.ArgumentParser) -> None:
    run.add_argument("--checkpoint-dir", metavar="DIR", help="save a checkpoint (commfx.save) here every --checkpoint-every steps")
    run.add_argument("--checkpoint-every", type=positive_int, default=0, metavar="N", help="steps between checkpoints (default: at the end)")
    run.add_argument("--resume", metavar="DIR", help="start from this checkpoint, or the latest complete one in this --checkpoint-dir")
    run.add_argument("--export", metavar="DIR", help="after the last step, write the whole model for transformers' from_pretrained "
                     "(HF models) into this new or empty directory (or an earlier export, which it replaces)")
    run.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="the model's dtype (float64 to compare runs digit for digit)")


def check_checkpoint_args(args, model, plan) -> None:
    """Options that cannot work, or would save nothing, fail here, each with what to do instead."""
    from .resume_checks import saved_step

    if args.checkpoint_every and not args.checkpoint_dir:
        raise PlanError("--checkpoint-every needs --checkpoint-dir DIR (where to save)")
    if args.precision != "fp32" and args.dtype != "float32":
        raise PlanError(
            f"--precision {args.precision} keeps float32 master weights and computes in {args.precision}; --dtype {args.dtype} asks "
            f"for {args.dtype} weights: give one of them (--dtype float64 alone to compare runs digit for digit)"
        )
    first = saved_step(args, model, plan) if args.resume else 0
    if args.checkpoint_dir:
        check_directory("--checkpoint-dir", args.checkpoint_dir)
        _check_schedule(args, first)
    if args.export:
        _check_export(args, model)


def _check_schedule(args, first: int) -> None:
    every = args.checkpoint_every or args.steps
    if not any(step % every == 0 for step in range(first + 1, args.steps + 1)):
        after = f" after resuming at step {first}" if first else ""
        raise PlanError(
            f"--checkpoint-every {every} with --steps {args.steps}{after} saves no checkpoint (the first would follow step "
            f"{(first // every + 1) * every}); lower --checkpoint-every, raise --steps, or leave --checkpoint-every out to save at the end"
        )


def _check_export(args, model) -> None:
    from ..checkpoint.hf import export_refusal

    if not hasattr(model, "save_pretrained"):
        raise PlanError(f"--export writes a transformers model for from_pretrained; {args.model} is not one (use an hf:<model_type> model)")
    target = Path(args.export).absolute()
    refusal = export_refusal(target)
    if refusal:
        raise PlanError(f"--export {args.export}: {refusal}")
    check_directory("--export", str(target.parent), shown=args.export)  # the export is made beside it, then renamed
    for option in ("checkpoint_dir", "resume", "dump", "json", "trace"):
        other = getattr(args, option)
        if other and _overlap(target, Path(other).absolute()):
            flag = "--" + option.replace("_", "-")
            raise PlanError(f"--export {args.export} and {flag} {other} overlap; an export replaces its whole directory: give them separate places")


def _overlap(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents
