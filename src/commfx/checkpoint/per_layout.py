"""What a checkpoint may change between the saving and the loading plan, and what it may not.

A checkpoint is the model's state: any plan over the same model loads it. Every tensor is
saved under its model-level name, whichever stage or tensor-parallel rank held it, so
passes may be added or dropped on resume; a stateful pass the new plan drops drops its
state, one it adds starts fresh, each with a one-line note (`pass_changes`).
Some state belongs to one layout and has no model-level name: `compress_pipeline`'s error-feedback residuals and PowerSGD Q (per pipeline
boundary, shaped by the stage cut and the micro-batch) and its data-parallel PowerSGD
state. It is saved rank by rank beside the model's tensors and restored at the layout
(and pass options) that saved it; a checkpoint holding it is refused at any other, by name.
"""

from __future__ import annotations

from .state import CheckpointError

PER_LAYOUT = {"compress_pipeline": "its error-feedback residuals and PowerSGD Q belong to the saved pipeline's boundaries"}
LAYOUT_KEYS = ("world_size", "dp", "ep", "pp", "tp")
LAYOUT_ATTRIBUTES = {"world_size": "world_size", "dp": "dp", "ep": "expert_parallel_size", "pp": "pp", "tp": "tp"}


# Passes whose runtime state a checkpoint carries, and what that state is. A plan without the
# pass drops it; a plan that adds the pass starts it fresh. Every other pass keeps no state.
STATEFUL = {
    "pack_experts": "expert placements and routing statistics",
    "compress_pipeline": "error-feedback residuals and PowerSGD factors",
}


def pass_changes(saved: list[str], here: list[str]) -> list[str]:
    """One note for each stateful pass the new plan drops or adds (a checkpoint is the
    model's state: any plan over the same model loads it)."""
    notes = [f"{p} is not in this plan: its {STATEFUL[p]} from the checkpoint are dropped" for p in STATEFUL if p in saved and p not in here]
    notes += [f"{p} is new in this plan: its {STATEFUL[p]} start fresh" for p in STATEFUL if p in here and p not in saved]
    return notes


def per_layout_specs(plan) -> dict[str, str]:
    """name -> the spec (with options) of each pass whose state is saved per layout, plus
    pipeline_split's (micro-batches and stage cut shape that state)."""
    names = set(PER_LAYOUT) & set(plan.pass_names())
    if not names:
        return {}
    return {p.name: f"{p.name}:{p.options}" for p in plan.passes if p.name in names or p.name == "pipeline_split"}


def pipeline_state(dm) -> dict | None:
    """A pipeline stage's codec state (compress_pipeline), None for another module."""
    if not hasattr(dm, "codec_state"):
        return None
    return {
        "stage": dm.stage_index,
        "codec_state": {k: {n: t.clone() for n, t in v.items()} for k, v in dm.codec_state.items()},
        "dp_codec_state": {n: t.clone() for n, t in dm.dp_codec_state.items()},
    }


def restore_pipeline_state(dm, state: dict) -> None:
    dm.codec_state = {int(k): {n: t.clone() for n, t in v.items()} for k, v in state["codec_state"].items()}
    dm.dp_codec_state = {n: t.clone() for n, t in state["dp_codec_state"].items()}


def same_layout(saved: dict, here: dict) -> bool:
    return all(saved[k] == here[k] for k in LAYOUT_KEYS)


def takes_pipeline_state(dm, manifest: dict) -> bool:
    """Whether this pipeline stage restores the codec state saved beside the model: only a
    plan that still compresses, at the saved layout (refuse_layout_change refused the rest)."""
    if pipeline_state(dm) is None or "compress_pipeline" not in dm.plan.pass_names():
        return False
    here = {k: getattr(dm.plan.topology, a) for k, a in LAYOUT_ATTRIBUTES.items()}
    return same_layout(manifest["layout"], here)


def refuse_layout_change(manifest: dict, here: dict, here_specs: dict[str, str], file) -> None:
    """Refuse a checkpoint whose per-layout state this layout (or these options) cannot take."""
    saved_specs = manifest.get("per_layout", {})
    kept = sorted(p for p in set(saved_specs) & set(PER_LAYOUT) if p in here_specs)  # a dropped pass drops its state
    if not kept:
        return
    saved = manifest["layout"]
    changed = [f"{k} {saved[k]} -> {here[k]}" for k in LAYOUT_KEYS if saved[k] != here[k]]
    changed += [f"{saved_specs[p]} -> {here_specs.get(p, 'none')}" for p in sorted(saved_specs) if saved_specs[p] != here_specs.get(p)]
    if changed:
        why = "; ".join(f"{p}: {PER_LAYOUT[p]}" for p in kept)
        raise CheckpointError(
            f"{file} holds {', '.join(kept)} state saved per layout ({why}), which does not reshard ({', '.join(changed)}). "
            f"Resume at the saved layout (--world-size {saved['world_size']} --pp {saved['pp']} --tp {saved['tp']}) "
            "with the same pass options"
        )
