"""`commfx.save` and `commfx.load`: a module, its optimizer and commfx's runtime state
through `torch.distributed.checkpoint`, atomically, and back at the same or another layout.

Two forms. The model form (every module but resize_tp's) saves each
tensor under its model-level name (`state.py`), so it loads at another world,
data-parallel, expert-parallel, tensor-parallel or pipeline size, packed or not; state
that belongs to one layout rides beside it rank by rank (`per_layout.py`). The rank form
(resize_tp, whose shard widths belong to one rank) saves each rank's own
state_dict and optimizer state_dict; it loads only at the layout that saved it, and any
other is refused by name. Both are collectives: every rank calls them at the same point.
"""

from __future__ import annotations

import io
import random
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from . import per_layout
from . import state as st
from . import store
from .chunks import LoadPlanner, SavePlanner
from .agree import agree
from .state import CheckpointError


def _pack(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def rank_form_reason(dm, optimizer=None) -> str | None:
    """Why `dm` is saved rank by rank (not resharded), or None for the model form."""
    if getattr(dm, "straggler", None) is not None:
        return "resize_tp (shard widths and migrated units are runtime state of one rank)"
    return None


def layout(plan) -> dict:
    """What a checkpoint records of the plan that saved it: sizes and passes."""
    sizes = {key: getattr(plan.topology, attribute) for key, attribute in per_layout.LAYOUT_ATTRIBUTES.items()}
    return {**sizes, "passes": plan.pass_names()}


def _rank_key(rank: int, what: str) -> str:
    return f"commfx/rank{rank}/{what}"


def _default_step(optimizer) -> int:
    steps = [int(s["step"]) for s in optimizer.state.values() if isinstance(s.get("step"), (int, float, torch.Tensor))]
    return max(steps, default=0)


def save(dm, optimizer: torch.optim.Optimizer, path, *, step: int | None = None) -> Path:
    """Write `dm`'s and `optimizer`'s state and commfx's runtime state to `path/step-NNNNNN`
    (atomically; `path/latest` names it) and return that directory. `step` defaults to the
    optimizer's step count. Collective: call on every rank."""
    start = time.perf_counter()
    root, rank = Path(path), dm.scheduler.rank
    step = _default_step(optimizer) if step is None else step
    if hasattr(dm, "synchronize"):
        dm.synchronize()  # gradients still on the wire (defer_grad_sync) and the step they owe
    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        store.clear_partials(root)

    agree(dm.scheduler, f"saving a checkpoint to {root}", prepare, on_rank=0)
    values: dict = {_rank_key(rank, "rng"): _pack(_rng_state())}
    reason = rank_form_reason(dm, optimizer)
    if reason is None:
        values.update(st.model_state(dm))
        values.update(st.optimizer_values(dm, optimizer))
        values[st.PARAM_GROUPS] = _pack(st.param_groups(dm, optimizer))
        values[st.RUNTIME] = _pack(st.runtime_state(dm))
        tensors = st.full_shapes(dm)
        pipeline = per_layout.pipeline_state(dm)
        if pipeline is not None:
            values[_rank_key(rank, "pipeline")] = _pack(pipeline)
    else:
        values[_rank_key(rank, "module")] = _pack(dm.state_dict())
        values[_rank_key(rank, "optimizer")] = _pack(optimizer.state_dict())
        tensors = dict(enumerate(dm.scheduler.all_gather_object(_rank_tensors(dm))))  # each rank's own
    partial = store.partial_dir(root, step)
    writer = FileSystemWriter(partial, single_file_per_rank=True, sync_files=True)
    agree(dm.scheduler, f"writing checkpoint {partial}", lambda: dcp.save(values, storage_writer=writer, planner=SavePlanner()))
    final = root / store.step_name(step)
    manifest = {"step": step, "form": "rank" if reason else "model", "rank_form_reason": reason, "layout": layout(dm.plan),
                "per_layout": per_layout.per_layout_specs(dm.plan), "tensors": tensors,
                "save_seconds": round(time.perf_counter() - start, 4)}
    agree(dm.scheduler, f"sealing checkpoint {final}", lambda: store.finish(root, step, manifest), on_rank=0)
    return final


def load(dm, optimizer: torch.optim.Optimizer | None, path) -> dict:
    """Restore what `save` wrote into `dm` and `optimizer` (distributed like the saved run, or,
    in the model form, at another world / dp / ep size). `path`: a checkpoint directory or the
    root `save` wrote into (its latest complete checkpoint). Returns {"step", "path", "notes"}.
    Refuses an incomplete, corrupted or foreign checkpoint, or a layout change it cannot
    make, with an error naming the file and what to do. Collective: call on every rank."""
    rank = dm.scheduler.rank
    found = None
    if rank == 0:
        try:
            checkpoint = store.resolve(path)
            found = (str(checkpoint), store.read_manifest(checkpoint), None)
        except CheckpointError as error:
            found = (None, None, str(error))
    where, manifest, error = dm.scheduler.all_gather_object(found)[0]
    if error:
        raise CheckpointError(error)
    checkpoint = Path(where)
    notes = _check_fits(dm, optimizer, manifest, checkpoint)
    reader = FileSystemReader(checkpoint)
    saved = reader.read_metadata().state_dict_metadata
    same_world = manifest["layout"]["world_size"] == dm.plan.topology.world_size
    objects = {_rank_key(rank, "rng"): b""} if same_world else {}
    if manifest["form"] == "rank":
        objects.update({_rank_key(rank, "module"): b"", _rank_key(rank, "optimizer"): b""})
    else:
        objects.update({st.RUNTIME: b"", **({st.PARAM_GROUPS: b""} if optimizer is not None else {})})
        pipeline_key = _rank_key(rank, "pipeline")
        if pipeline_key in saved and per_layout.takes_pipeline_state(dm, manifest):
            objects[pipeline_key] = b""
    dcp.load(objects, storage_reader=reader, planner=DefaultLoadPlanner())
    if manifest["form"] == "rank":
        dm.load_state_dict(_unpack(objects[_rank_key(rank, "module")]))
        if optimizer is not None:
            optimizer.load_state_dict(_unpack(objects[_rank_key(rank, "optimizer")]))
    else:
        notes += st.restore_runtime(dm, _unpack(objects[st.RUNTIME]))  # placements first: they decide the chunks
        if objects.get(pipeline_key):
            per_layout.restore_pipeline_state(dm, _unpack(objects[pipeline_key]))
        gather = getattr(getattr(dm, "grad_sync", None), "params", None)  # shard_states:stage=3
        if gather is not None:
            gather.gather_all()  # load into whole parameters, then cut this rank's shards
        values = st.model_state(dm)
        if optimizer is not None:
            values.update(st.optimizer_values(dm, optimizer, saved))
        dcp.load(values, storage_reader=FileSystemReader(checkpoint), planner=LoadPlanner())
        if gather is not None:
            gather.refresh_shards()
        if optimizer is not None:
            st.restore_param_groups(dm, optimizer, _unpack(objects[st.PARAM_GROUPS]), str(checkpoint / store.MANIFEST))
            _restore_objects(dm, optimizer, values)
    if same_world:
        _set_rng_state(_unpack(objects[_rank_key(rank, "rng")]))
    else:
        notes.append(f"random number generators not restored (saved by {manifest['layout']['world_size']} ranks)")
    dm.scheduler.barrier()
    return {"step": int(manifest["step"]), "path": checkpoint, "notes": notes}


def _rank_tensors(dm) -> dict:
    return {n: (list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in dm.named_parameters()}


def _restore_objects(dm, optimizer, values: dict) -> None:
    """Optimizer state held as Python values (not tensors), read back into the optimizer."""
    params = dict(dm.module.named_parameters())
    for fqn, value in values.items():
        if fqn.startswith(st.OPTIMIZER) and fqn != st.PARAM_GROUPS and not isinstance(value, torch.Tensor) and not hasattr(value, "pieces"):
            name, _, key = fqn[len(st.OPTIMIZER):].rpartition("/")
            optimizer.state[params[name]][key] = value


def _check_fits(dm, optimizer, manifest: dict, checkpoint: Path) -> list[str]:
    """Refuse a checkpoint of another model, plan or (rank form) layout; list what reshards."""
    file = checkpoint / store.MANIFEST
    saved, here = manifest["layout"], layout(dm.plan)
    per_layout.refuse_layout_change(manifest, here, per_layout.per_layout_specs(dm.plan), file)
    notes = per_layout.pass_changes(saved["passes"], here["passes"])
    reason = rank_form_reason(dm, optimizer)
    if manifest["form"] == "rank" or reason:
        why = manifest.get("rank_form_reason") or reason
        changed = [f"{k} {saved[k]} -> {here[k]}" for k in ("world_size", "dp", "ep", "pp", "tp") if saved[k] != here[k]]
        if changed:
            raise CheckpointError(
                f"{file} was saved rank by rank because of {why}; resharding it ({', '.join(changed)}) is not supported yet. "
                f"Resume at the saved layout (--world-size {saved['world_size']} --ep {saved['ep']} --pp {saved['pp']} --tp {saved['tp']})"
            )
        if manifest["form"] != ("rank" if reason else "model"):
            raise CheckpointError(f"{file} was saved in the {manifest['form']} form, which this module ({why}) does not load")
    mine = {n: [list(s), d] for n, (s, d) in (_rank_tensors(dm) if reason else st.full_shapes(dm)).items()}
    saved_tensors = manifest["tensors"][str(dm.scheduler.rank)] if manifest["form"] == "rank" else manifest["tensors"]
    theirs = {n: list(v) for n, v in saved_tensors.items()}
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        differ = [f"{n} {theirs[n][0]} {theirs[n][1]} saved, {mine[n][0]} {mine[n][1]} here" for n in sorted(set(mine) & set(theirs)) if mine[n] != theirs[n]]
        detail = "; ".join(filter(None, [
            f"not in it: {', '.join(missing[:4])}" if missing else "",
            f"not in this model: {', '.join(extra[:4])}" if extra else "",
            f"different: {', '.join(differ[:3])}" if differ else "",
        ]))
        raise CheckpointError(f"{file} holds another model ({detail}); load it into the model (and dtype) it was saved from")
    changed = [f"{k} {saved[k]} -> {here[k]}" for k in per_layout.LAYOUT_KEYS if saved[k] != here[k]]
    return notes + ([f"resharded: {', '.join(changed)}"] if changed else [])


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
