"""expert_parallel: shard experts over the ep group and route tokens with all-to-all.

Each lifted block `dispatch -> expert_ffn -> combine` becomes

    dispatch -> exchange_counts -> all_to_all -> group_by_expert
             -> expert_ffn (local E/ep experts) -> group_by_expert(inverse) -> all_to_all -> combine

Dispatch sorts rows by global expert id; experts [r*E/ep, (r+1)*E/ep) live on ep rank r, so
rows are already grouped by destination rank. Dropless mode sends uneven splits; capacity
mode pads every expert to the same capacity (see `ops.moe.moe_dispatch` for the drop
policy). Non-expert parameters stay replicated (data parallel); the runtime shards the
expert weights as `program.runtime.shards` says, so the graph is the same on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..plan import Plan, PlanError
from ..compiler.program import Program, stamp
from ..compiler.regions import ExpertExchange, MoEBlock
from ..compiler.rewrite import Rewriter
from .base import Pass, PassError, register
from .dispatch_codec import check_codec, dispatch_all_to_all
from .lift import find_experts_modules

commfx = torch.ops.commfx
PASS = "expert_parallel"


@register(PASS, rewrites=("moe_blocks", "unmatched_moe"), requires="moe lifted", ensures="expert parallel")
class ExpertParallel(Pass):
    """Shard experts over ranks; route tokens with (uneven) all-to-all.

    (GShard / Switch-style expert parallelism; the substrate Lina and LocMoE build on.)
    It also runs on a graph with MoE-looking modules no recogniser matched, to name them.
    """

    @classmethod
    def capacity_factor(cls, options) -> float:
        return options.capacity_factor

    @classmethod
    def ensured(cls, options) -> tuple[str, ...]:
        return cls.ensures + (("capacity routing",) if options.capacity_factor > 0 else ())

    @dataclasses.dataclass(frozen=True)
    class Options:
        capacity_factor: float = 0.0  # 0: dropless (uneven all-to-all); > 0: fixed capacity per expert
        # True where the caller owns full-size expert weights (torch.compile backend): the
        # graph slices this rank's experts at run time instead of the runtime re-allocating them.
        shard_in_graph: bool = False
        # how dispatch rows cross: rows (their own dtype) or fp8 (e4m3, a scale per 128 values,
        # DeepEP's recipe; needs --precision bf16; combine and gradients stay bf16)
        dispatch: str = "rows"

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.capacity_factor < 0:
            raise PlanError(f"expert_parallel capacity_factor must be >= 0 (0 = dropless), got {options.capacity_factor}")
        check_codec(plan, options.dispatch)
        if model is None:
            return
        ep = plan.topology.expert_parallel_size
        found = find_experts_modules(model)
        matched = [(path, module) for path, module, pattern in found if pattern is not None]
        if not matched:
            unmatched = [f"{path} ({type(m).__name__})" for path, m, _ in found]
            hint = f" Modules that look like MoE but match no recogniser: {', '.join(unmatched)}." if unmatched else ""
            raise PlanError(
                f"expert_parallel was requested but {type(model).__name__} has no MoE block commfx recognises.{hint} "
                "Drop expert_parallel from --passes, or add a recogniser to commfx.passes.lift.EXPERTS_PATTERNS."
            )
        for path, module in matched:
            experts = next(p for p in module.parameters(recurse=False) if p.dim() == 3).shape[0]
            if experts % ep:
                raise PlanError(
                    f"{path} has {experts} experts, which do not divide evenly over expert-parallel size {ep}; "
                    f"choose ep from {[d for d in range(1, experts + 1) if experts % d == 0 and plan.topology.world_size % d == 0]} "
                    "(--ep) or a world size whose ep divides the expert count"
                )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        blocks = program.regions.moe_blocks
        if not blocks:
            unmatched = program.regions.unmatched_moe
            raise PassError(
                "expert_parallel found no lifted MoE block in the graph"
                + (f" (unrecognised MoE-like modules: {', '.join(unmatched)})" if unmatched else "")
            )
        ep = plan.topology.expert_parallel_size
        rw = Rewriter(program, PASS)
        for block in blocks:
            if block.num_experts % ep:
                raise PassError(f"{block.path}: {block.num_experts} experts do not divide over ep={ep}")
            block.dispatch_codec = options.dispatch
            _distribute_block(rw, block, ep, options.capacity_factor)
            if options.shard_in_graph:
                _slice_weights_in_graph(rw, block.experts[0], ep)
                continue
            for target in (block.gate_up, block.down):
                program.runtime.shards[target] = {"dim": 0, "group": "ep", "parts": ep, "replicated_over": "edp"}
        rw.finish()
        return True


def set_capacity(program: Program, capacity_factor: float) -> None:
    """Switch every lifted dispatch to capacity mode (also used for the 1-rank reference)."""
    for block in program.regions.moe_blocks:
        dispatch = block.dispatch
        dispatch.args = (*dispatch.args[:3], float(capacity_factor))
    program.gm.recompile()


def _slice_weights_in_graph(rw: Rewriter, ffn: fx.Node, ep: int) -> None:
    rows, counts, gate_up, down, activation = ffn.args
    local = []
    for weight in (gate_up, down):
        # Right after the weight, not before this use: later passes (partition_a2a) add uses
        # of the local shard earlier in the graph than this expert_ffn.
        with rw.after(weight):
            local.append(rw.call(commfx.local_shard.default, (weight, "ep", ep), purpose="this rank's experts", like=None))
    ffn.args = (rows, counts, *local, activation)


def _distribute_block(rw: Rewriter, block: MoEBlock, ep: int, capacity_factor: float) -> None:
    dispatch, (ffn,), combine = block.dispatch, block.experts, block.combine
    dispatch.args = (*dispatch.args[:3], float(capacity_factor))
    rows, counts, gate_up, down, activation = ffn.args
    local_experts = block.num_experts // ep

    def make(target, args, purpose):
        return rw.call(target, args, purpose=purpose, like=ffn)

    with rw.before(ffn):
        send_counts = make(torch.ops.aten.view.default, (counts, [ep, local_experts]), "rows per (dest rank, expert)")
        recv_counts = make(commfx.exchange_counts.default, (counts, "ep", ep), "exchange token counts")
        if block.dispatch_codec == "rows":
            received = make(commfx.all_to_all.default, (rows, send_counts, recv_counts, "ep"), "dispatch all-to-all")
        else:
            received = dispatch_all_to_all(make, rows, send_counts, recv_counts, "ep", "a2a", "", block.dispatch_codec, "dispatch all-to-all")
        local_rows = make(commfx.group_by_expert.default, (received, recv_counts, False), "source-major -> expert-major")
        local_counts = make(torch.ops.aten.sum.dim_IntList, (recv_counts, [0]), "rows per local expert")
    ffn.args = (local_rows, local_counts, gate_up, down, activation)
    with rw.after(ffn):
        back = make(commfx.group_by_expert.default, (ffn, recv_counts, True), "expert-major -> source-major")
    with rw.after(back):
        returned = make(commfx.all_to_all.default, (back, recv_counts, send_counts, "ep"), "combine all-to-all")
    combine.replace_input_with(ffn, returned)
    stamp(ffn, PASS, f"local experts ({local_experts} of {block.num_experts})")
    block.exchange = ExpertExchange(rows, counts, send_counts, recv_counts, received, local_rows, local_counts, back, returned)
