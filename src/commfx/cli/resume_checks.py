"""`commfx run --resume`: what the checkpoint's manifest says, checked against the model,
the plan and --steps in the command's own process, before any rank starts.

The ranks check again when they load (commfx.load), but a mismatch known from
`commfx.json` is one line here instead of a failure on every rank after start-up."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import per_layout, store
from ..checkpoint.io import layout
from ..plan import PlanError


def saved_step(args, model, plan) -> int:
    """The step the --resume checkpoint was saved after, once it is known to fit this run."""
    checkpoint = store.resolve(args.resume)
    manifest = store.read_manifest(checkpoint)  # incomplete, corrupted: refused here
    file = checkpoint / store.MANIFEST
    _check_layout(manifest, plan, file)
    _check_model(manifest, model, args, file)
    step = int(manifest["step"])
    if step >= args.steps:
        raise PlanError(
            f"--resume {args.resume}: the checkpoint was saved after step {step} and --steps {args.steps} leaves nothing to train; "
            f"give --steps above {step} (--steps counts from the start of training, not from the checkpoint)"
        )
    return step


def _check_layout(manifest: dict, plan, file: Path) -> None:
    here = layout(plan)
    per_layout.refuse_layout_change(manifest, here, per_layout.per_layout_specs(plan), file)
    saved = manifest["layout"]
    changed = [f"{k} {saved[k]} -> {here[k]}" for k in per_layout.LAYOUT_KEYS if saved[k] != here[k]]
    if manifest["form"] == "rank" and changed:
        raise PlanError(
            f"{file} was saved rank by rank because of {manifest.get('rank_form_reason')}; resharding it ({', '.join(changed)}) "
            f"is not supported yet: resume with --world-size {saved['world_size']} --ep {saved['ep']} --pp {saved['pp']} --tp {saved['tp']}"
        )


def _check_model(manifest: dict, model, args, file: Path) -> None:
    """The model form names every tensor with its full shape and dtype: compare them with
    this model at --dtype (the rank form, saved rank by rank, is checked by the ranks)."""
    if manifest["form"] != "model":
        return
    saved = {name: (list(shape), dtype) for name, (shape, dtype) in manifest["tensors"].items()}
    params = {n: (list(p.shape), args.dtype if p.is_floating_point() else str(p.dtype).removeprefix("torch."))
              for n, p in model.named_parameters()}
    missing = sorted(set(params) - set(saved))
    differ = [n for n in params if n in saved and saved[n][0] != params[n][0]]
    if missing or differ or not set(params) & set(saved):
        detail = "; ".join(filter(None, [
            f"not in it: {', '.join(missing[:3])}" if missing else "",
            f"other shapes: {', '.join(f'{n} {saved[n][0]} saved, {params[n][0]} here' for n in differ[:2])}" if differ else "",
        ]))
        raise PlanError(f"{file} holds another model than {args.model} ({detail}); resume with the model that saved it")
    dtypes = sorted({saved[n][1] for n in params if n in saved and model.get_parameter(n).is_floating_point()})
    if dtypes and dtypes != [args.dtype]:
        raise PlanError(f"{file} holds {'/'.join(dtypes)} parameters and this run is {args.dtype}: resume with --dtype {dtypes[0]}")
