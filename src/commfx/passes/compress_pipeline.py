"""compress_pipeline: send the backward activation gradients between stages as low-rank factors.

Optimus-CC (Song et al., ASPLOS 2023): PowerSGD rank-r factors of each boundary's
activation gradient with lazy error propagation, compressing only the sends on the
critical path (the 1F1B epilogue), plus one fused all-reduce for an embedding tied across
the first and last stage. Forward activations stay exact. Selective stage compression
(`dp_stages=w`) also sends the data-parallel gradient all-reduce of the stages before w as
PowerSGD factors (ops/powersgd_allreduce.py).
"""

from __future__ import annotations

import dataclasses

from ..compiler.program import Program
from ..ops.compress import LowRankCodec
from ..ops.powersgd_allreduce import DataParallelPowerSGD
from ..plan import Plan, PlanError
from .base import Pass, register

PASS = "compress_pipeline"


@register(PASS, requires="pipeline split")
class CompressPipeline(Pass):
    """Optimus-CC: low-rank (PowerSGD) backward traffic between pipeline stages, epilogue only.

    Each boundary gets a codec the runtime calls (ops/compress.py); options pick the rank,
    lazy error propagation, epilogue-only sends, the fused tied-embedding sync, and the boundaries.
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        rank: int = 16
        error_feedback: bool = True  # lazy error propagation
        epilogue_only: bool = True  # compress only the 1F1B cool-down and the last steady-state send
        fuse_embedding_sync: bool = True  # one all-reduce over {first, last stage} x dp for a tied weight
        boundaries: str = "all"  # "all", "none", or boundary indices joined by '+' (e.g. 0+2)
        dp_stages: int = 0  # selective stage compression: PowerSGD dp all-reduce on stages 0..dp_stages-1
        dp_rank: int = 4  # the rank of those factors

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.rank < 1:
            raise PlanError(f"compress_pipeline rank must be at least 1, got {options.rank}")
        _chosen(options.boundaries, plan.topology.pp - 1)
        pp, dp = plan.topology.pp, plan.topology.dp
        if not 0 <= options.dp_stages <= pp:
            raise PlanError(
                f"compress_pipeline dp_stages={options.dp_stages}: the stages to compress the data-parallel "
                f"all-reduce of are 0..dp_stages-1, so write a number from 0 to pp={pp}"
            )
        if options.dp_stages and dp == 1:
            raise PlanError(
                f"compress_pipeline dp_stages={options.dp_stages} compresses the data-parallel all-reduce, but this "
                f"plan has dp=1 (world {plan.topology.world_size} = pp {pp} x tp {plan.topology.tp}): use a world of "
                f"pp x dp ranks with dp >= 2, or leave dp_stages at 0"
            )
        if options.dp_rank < 1:
            raise PlanError(f"compress_pipeline dp_rank must be at least 1, got {options.dp_rank}")

    @classmethod
    def evidence(cls, program: Program, options: Options) -> dict[str, int]:
        pipeline = program.regions.pipeline
        if pipeline is None:
            return {}
        found = {
            "boundary codecs": sum(1 for b in pipeline.boundaries if b.codec is not None),
            "data-parallel codecs": sum(1 for s in pipeline.stages if getattr(s, "dp_codec", None) is not None),
        }
        return {what: n for what, n in found.items() if n}

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        pipeline = program.regions.pipeline
        codec = LowRankCodec(options.rank, options.error_feedback, options.epilogue_only)
        chosen = _chosen(options.boundaries, len(pipeline.boundaries))
        program.regions.pipeline = dataclasses.replace(  # the stages and boundaries of the program before stay as they were
            pipeline,
            boundaries=[dataclasses.replace(b, codec=codec) if b.index in chosen else b for b in pipeline.boundaries],
            stages=[dataclasses.replace(s, dp_codec=DataParallelPowerSGD(options.dp_rank, options.error_feedback))
                    if s.index < options.dp_stages else s for s in pipeline.stages],
            fuse_shared_sync=options.fuse_embedding_sync,
        )
        return True


def _chosen(text: str, count: int) -> set[int]:
    if text == "all":
        return set(range(count))
    if text == "none":
        return set()
    try:
        chosen = {int(part) for part in text.split("+")}
    except ValueError:
        chosen = None
    if not chosen or any(i < 0 or i >= count for i in chosen):
        raise PlanError(
            f"compress_pipeline boundaries={text!r}: write 'all', 'none' or indices joined by '+' from 0 to {count - 1} "
            f"(boundary i sits between stages i and i + 1)"
        )
    return chosen
