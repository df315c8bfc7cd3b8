"""compress_pipeline: send the backward activation gradients between stages as low-rank factors.

Optimus-CC (Song et al., ASPLOS 2023): PowerSGD rank-r factors of each boundary's
activation gradient with lazy error propagation, compressing only the sends on the
critical path (the 1F1B epilogue), plus one fused all-reduce for an embedding tied across
the first and last stage. Forward activations stay exact.
"""

from __future__ import annotations

import dataclasses

from ..compiler.program import Program
from ..ops.compress import LowRankCodec
from ..plan import Plan, PlanError
from .base import Pass, PassError, register

PASS = "compress_pipeline"


@register
class CompressPipeline(Pass):
    """Optimus-CC: low-rank (PowerSGD) backward traffic between pipeline stages, epilogue only.

    Each boundary gets a codec the runtime calls (ops/compress.py); options pick the rank,
    lazy error propagation, epilogue-only sends, the fused tied-embedding sync, and the boundaries.
    """

    name = PASS
    requires = ("pipeline split",)
    requires_passes = ("pipeline_split",)

    @dataclasses.dataclass(frozen=True)
    class Options:
        rank: int = 16
        error_feedback: bool = True  # lazy error propagation
        epilogue_only: bool = True  # compress only the 1F1B cool-down and the last steady-state send
        fuse_embedding_sync: bool = True  # one all-reduce over {first, last stage} x dp for a tied weight
        boundaries: str = "all"  # "all" or boundary indices joined by '+' (e.g. 0+2)

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.rank < 1:
            raise PlanError(f"compress_pipeline rank must be at least 1, got {options.rank}")
        _chosen(options.boundaries, plan.topology.pp - 1)

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        pipeline = program.annotations.get("pipeline")
        if pipeline is None:
            raise PassError("compress_pipeline needs a split program; put pipeline_split before it")
        codec = LowRankCodec(options.rank, options.error_feedback, options.epilogue_only)
        for boundary in pipeline.boundaries:
            if boundary.index in _chosen(options.boundaries, len(pipeline.boundaries)):
                boundary.codec = codec
        pipeline.fuse_shared_sync = options.fuse_embedding_sync
        return True


def _chosen(text: str, count: int) -> set[int]:
    if text == "all":
        return set(range(count))
    try:
        chosen = {int(part) for part in text.split("+")}
    except ValueError:
        chosen = None
    if not chosen or any(i < 0 or i >= count for i in chosen):
        raise PlanError(
            f"compress_pipeline boundaries={text!r}: write 'all' or indices joined by '+' from 0 to {count - 1} "
            f"(boundary i sits between stages i and i + 1)"
        )
    return chosen
