"""shard_states: ZeRO. Each data-parallel rank keeps only its shard of the optimizer state
(stage 1), of the reduced gradients (stage 2) and of the parameters (stage 3) instead of a
replica.

(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020.) The gradient buckets (`commfx.buckets`) become flat buffers cut into
one contiguous shard per rank of their group. Stage 1 all-reduces them as before and each
rank steps only its shard; stage 2 reduce-scatters them instead, so a rank only ever holds
its shard of the gradient. After the step the updated shards are all-gathered into every
rank's parameters. Replicated parameters shard over `dp`; expert shards over their own
expert-data-parallel group `edp` (a group of one when ep == world: those stay whole, as
they are not replicated). Lossless: the same parameters after every step (float64 tests),
since torch's per-parameter optimizers (SGD, Adam, AdamW) update each element from its own
gradient and state.

The graph does not change: the pass marks the program, and the runtime
(`runtime/state_shards.py`, `runtime/sharded_optimizer.py`) does the rest. The optimizer
must be the sharded one: `commfx.shard_optimizer(dm, torch.optim.AdamW, lr=...)` (what
`commfx run` does). Stage 3 keeps each bucket's parameters as one flat buffer freed between
uses: the runtime (`runtime/param_gather.py`) all-gathers a bucket just before the first
node of the forward or backward graph that reads it, the next one while it computes, and
frees it after the last (FSDP's scheme, driven by the lowered graphs' order).
"""

from __future__ import annotations

import dataclasses

from ..buckets import Entry, make_buckets, shard_size
from ..compiler.program import Program
from ..cost.moe import grad_chunk_bytes
from ..plan import Plan, PlanError
from .base import RuntimeSetting, register

PASS = "shard_states"
STAGES = (1, 2, 3)

# Passes whose work the sharded step does not handle yet -> why: refused by name, in either order
# (check_plan), since each needs its own sharding rather than another place in the list.
REFUSED_PASSES = {
    "resize_tp": "its migrations move optimizer state, which is sharded here",
    "defer_grad_sync": "a deferred gradient's late step would have to reduce-scatter and all-gather on its own",
    "pack_experts": "re-placing experts moves their optimizer state, which is sharded here",
}


@register(PASS, setting="shard_states", ensures="states sharded")
class ShardStates(RuntimeSetting):
    """ZeRO stage 1/2/3: optimizer state (and gradients, and parameters) sharded over the data-parallel ranks.

    (Rajbhandari et al., ZeRO, SC 2020.)
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        stage: int = 1
        # each bucket's size, so its shards': bytes, 0 (the plan's grad_bucket_bytes, 1 MiB), or auto: the smallest
        # whose collectives spend at most a tenth of their time on per-call costs (the most buckets to prefetch)
        bucket_bytes: str = "0"

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.stage not in STAGES:
            raise PlanError(f"shard_states:stage must be 1, 2 or 3 (ZeRO stages), got {options.stage}")
        if options.bucket_bytes != "auto" and (not options.bucket_bytes.isdigit()):
            raise PlanError(
                f"shard_states:bucket_bytes must be bytes >= 0 (0: the plan's grad_bucket_bytes) or auto, got {options.bucket_bytes}"
            )
        for name in plan.pass_names():
            if name in REFUSED_PASSES:
                raise PlanError(f"shard_states does not work with {name} yet: {REFUSED_PASSES[name]}; drop one of them")
        if plan.topology.pp > 1 and plan.topology.tp > 1:
            raise PlanError(
                "shard_states with both pipeline stages and tensor parallelism (pp x tp x dp) is not verified yet; "
                "it shards over dp with --pp or with --tp, one at a time"
            )

    @classmethod
    def value(cls, options: Options) -> dict:
        return {"stage": options.stage, "bucket_bytes": 0 if options.bucket_bytes == "auto" else int(options.bucket_bytes)}

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        super().run(program, options, plan)
        if options.bucket_bytes == "auto":  # from the topology's figures (Plan(machine="measure"): this machine's)
            program.runtime.shard_states["bucket_bytes"] = grad_chunk_bytes(plan.topology, sharded=True)
            program.notes.append(f"{PASS}: bucket_bytes=auto: {program.runtime.shard_states['bucket_bytes']:,} bytes, the smallest "
                                 "whose all-gather and reduce-scatter spend at most a tenth of their time on per-call costs")
        bucket_bytes = program.runtime.shard_states["bucket_bytes"] or plan.grad_bucket_bytes
        program.notes.extend(layout_notes(program, options.stage, bucket_bytes, plan))
        return False


def layout_notes(program: Program, stage: int, bucket_bytes: int, plan: Plan) -> list[str]:
    """What each rank holds, bucket by bucket, as `commfx dump` prints it."""
    what = ("optimizer state", "optimizer state and reduced gradients", "optimizer state, reduced gradients and parameters")[stage - 1]
    sizes = {name: len(ranks[0]) for name, ranks in plan.topology.process_groups().items()}
    shards, in_graph = program.runtime.shards, set(program.runtime.reduced_in_graph)
    names, entries = [], []
    for name, param in program.gm.named_parameters(remove_duplicate=False):
        spec = shards.get(name)
        group = None if name in in_graph or not param.requires_grad else (spec["replicated_over"] if spec else "dp")
        numel = param.numel() // (spec["parts"] if spec else 1)  # expert shards: this rank's part
        names.append(name)
        entries.append(Entry(group, param.dtype, numel, param.element_size()))
    buckets = make_buckets(entries, bucket_bytes)
    reduce = "all-reduced, each rank steps its shard" if stage == 1 else "reduce-scattered into each rank's shard"
    after = ("then the updated shards all-gathered into the parameters" if stage < 3 else
             "each bucket's parameters all-gathered before its first use in forward and in backward (the next bucket prefetched), freed after its last")
    notes = [f"shard_states: stage {stage}: {what} sharded; buckets of <= {bucket_bytes:,} bytes {reduce}, {after}"]
    if plan.topology.pp > 1:  # the stages are cut after this pass: each buckets its own parameters over its own dp group
        gathered = "; stage 3 gathers a stage's buckets once per step, for all its micro-batches" if stage >= 3 else ""
        return notes + [f"shard_states: per pipeline stage: each stage cuts its own parameters into buckets over its dp group{gathered}"]
    for index, (group, members) in enumerate(buckets):
        numel = sum(entries[i].numel for i in members)
        parts = sizes.get(group, 1)
        held = "whole (a group of one)" if parts == 1 else f"{shard_size(numel, parts):,} per rank (1/{parts})"
        listed = ", ".join(names[i] for i in members[:3]) + (f", +{len(members) - 3} more" if len(members) > 3 else "")
        notes.append(f"shard_states: bucket {index} over {group} ({parts} rank{'s' if parts != 1 else ''}): {numel:,} elements, {held}: {listed}")
    unbucketed = [n for n, e in zip(names, entries) if e.group is None]
    if unbucketed:
        notes.append(f"shard_states: not sharded (no gradient here, or reduced in the graph): {', '.join(unbucketed)}")
    return notes
