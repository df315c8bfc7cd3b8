"""What a checkpoint may change between the saving and the loading plan, and what it may not.

Passes that only choose a layout (`pipeline_split`, `tensor_parallel`, `shard_states`) may be added or
dropped on resume: every tensor is saved under its model-level name, whichever stage or
tensor-parallel rank held it. Some state belongs to one layout and has no model-level
name: `compress_pipeline`'s error-feedback residuals and PowerSGD Q (per pipeline
boundary, shaped by the stage cut and the micro-batch) and its data-parallel PowerSGD
state. It is saved rank by rank beside the model's tensors and restored at the layout
(and pass options) that saved it; a checkpoint holding it is refused at any other, by name.
"""

from __future__ import annotations

from .state import CheckpointError

LAYOUT_PASSES = ("pipeline_split", "tensor_parallel", "shard_states")
PER_LAYOUT = {"compress_pipeline": "its error-feedback residuals and PowerSGD Q belong to the saved pipeline's boundaries"}
LAYOUT_KEYS = ("world_size", "dp", "ep", "pp", "tp")


def stateful_passes(passes: list[str]) -> list[str]:
    """The passes a resume must keep: all but those that only choose a layout."""
    return [p for p in passes if p not in LAYOUT_PASSES]


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


def refuse_layout_change(manifest: dict, here: dict, here_specs: dict[str, str], file) -> None:
    """Refuse a checkpoint whose per-layout state this layout (or these options) cannot take."""
    saved_specs = manifest.get("per_layout", {})
    kept = sorted(set(saved_specs) & set(PER_LAYOUT))
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
