"""What a compiled program chose by itself: each pass option the plan leaves at `auto`, with
the value the pass's cost model picked from the topology's figures.

`commfx bench` records them with every plan and `commfx simulate --validate` compares them
with the simulator's own compile: a prediction is of the program that ran only when both
chose alike. Keys are `pass:option`, values text (as the option would be written).
"""

from __future__ import annotations

import re

from ..compiler.program import Program
from ..plan import Plan
from .base import plan_options

__all__ = ["automatic_choices", "choices_from_notes"]


def automatic_choices(program: Program, plan: Plan) -> dict[str, str]:
    """`pass:option` -> the value compiled, for every option of the plan set to auto."""
    names = set(plan.pass_names())
    out: dict[str, str] = {}
    if "partition_a2a" in names:
        options = plan_options(plan, "partition_a2a")
        if options.k == "auto":
            out["partition_a2a:k"] = "/".join(str(k) for k in sorted({b.chunks for b in program.regions.moe_blocks}))
        if options.grad_chunk_bytes == "auto" and options.priority:
            out["partition_a2a:grad_chunk_bytes"] = str(program.runtime.comm_schedule.grad_chunk_bytes)
    if "shard_states" in names and plan_options(plan, "shard_states").bucket_bytes == "auto":
        out["shard_states:bucket_bytes"] = str(program.runtime.shard_states.get("bucket_bytes", 0))
    sites = program.decisions.get("hierarchical_a2a", {})
    if sites:  # enabled=auto: the algorithm of each MoE block's dispatch and combine
        out["hierarchical_a2a:enabled"] = ",".join(f"{key}={d['algorithm']}" for key, d in sorted(sites.items()))
    decisions = program.decisions.get("split_embedding_comm", {})
    for key, heads in (("strategy", False), ("head", True)):  # what the cost model picked, table by table
        picks = {w: d["strategy"] for w, d in decisions.items() if d.get("reason") == "cost model" and bool(d.get("head")) == heads}
        if picks:
            out[f"split_embedding_comm:{key}"] = ",".join(f"{w}={s}" for w, s in sorted(picks.items()))
    return out


def choices_from_notes(notes: list[str]) -> dict[str, str]:
    """The choices older `commfx bench` runs kept only as notes (partition_a2a's line)."""
    out: dict[str, str] = {}
    for note in notes:
        if not note.startswith("partition_a2a:"):
            continue
        k = re.search(r"k=([\d/]+) chunks", note)
        if k and "k=auto" in note:
            out["partition_a2a:k"] = k.group(1)
        chunk = re.search(r"gradient chunks of ([\d,]+) bytes", note)
        if chunk:
            out["partition_a2a:grad_chunk_bytes"] = chunk.group(1).replace(",", "")
    return out
