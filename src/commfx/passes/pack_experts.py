"""pack_experts: send each token once per destination rank, experts placed by affinity (Lina).

Plain expert parallelism sends one row per (token, expert): a top-2 token whose experts share
a rank crosses the wire twice each way. After this pass a token goes to each rank at most once
with its routing weights and the local ids of the experts it needs there (DeepEP's
`is_token_in_rank` layout); the expert rank runs them and sums their weighted outputs, and
one row comes back. Rows on the wire are the unique (token, destination rank) pairs. Each
expert-parallel block

    dispatch -> all_to_all -> experts -> all_to_all -> combine (at the source)

becomes

    expert_slots -> rank_dispatch -> attach_meta -> all_to_all (rows + weights + ids) -> detach_meta
                 -> packed_expert_ffn (the rank's experts and their weighted sum, one fused kernel)
                 -> all_to_all -> scatter_add_tokens

`expert_slots` asks the runtime where each expert lives now: the runtime records routing
statistics and, every `replace_every` optimizer steps, re-places experts so that experts
often chosen together share a rank (runtime/expert_placement.py), moving weights and
optimizer state. Capacity mode drops exactly what expert_parallel drops. partition_a2a,
after this pass, chunks the packed exchange (split by destination rank runs). Lossless:
the same sums as expert parallelism, in another grouping (tested in float64).
(Lina, USENIX ATC 2023; DeepEP's dispatch layout.)
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..compiler.program import Program
from ..compiler.regions import MoEBlock, PackedExchange
from ..compiler.rewrite import Rewriter
from ..plan import Plan, PlanError
from .base import Pass, PassError, register
from .dispatch_codec import dispatch_all_to_all
from ..cost.moe import MoERegion, packing_degree

commfx = torch.ops.commfx
PASS = "pack_experts"


@register(
    PASS, rewrites="moe_blocks", requires="expert parallel", ensures="experts packed",
    refuses={**Pass.refuses, "all-to-all partitioned": "partition_a2a chunks the packed exchange"},
)
class PackExperts(Pass):
    """Send each token once per destination rank; the expert rank combines its experts.

    (Lina, USENIX ATC 2023.)
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        replace_every: int = 0  # re-place experts by affinity every N optimizer steps (0: never)
        balance: float = 0.1  # load bound of a placement: max rows per rank <= (1 + balance) * mean
        # move experts only when the all-to-all bytes the new placement saves a step repay the
        # bytes the move sends (weights and optimizer state) within this many steps (inf: always)
        payback: float = 32.0
        # experts per device: an integer (must be E / ep: set --ep), or auto (the cost model's
        # recommendation is reported by `commfx dump`; the topology's ep is kept)
        degree: str = "auto"

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model: torch.nn.Module | None) -> None:
        if options.replace_every < 0:
            raise PlanError(f"pack_experts replace_every must be >= 0 (0 = never re-place), got {options.replace_every}")
        if options.degree != "auto":
            _check_degree(plan, options.degree, model)
        if options.balance < 0:
            raise PlanError(f"pack_experts balance must be >= 0 (max rows per rank <= (1 + balance) * mean), got {options.balance}")
        if not options.payback >= 0:
            raise PlanError(
                f"pack_experts payback must be >= 0 (steps within which a move's saved all-to-all bytes repay its own; "
                f"inf: move whenever the placement improves), got {options.payback}"
            )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        blocks = program.regions.moe_blocks
        if not blocks:
            raise PassError("pack_experts found no expert-parallel MoE block in the graph")
        ep = plan.topology.expert_parallel_size
        rw = Rewriter(program, PASS)
        previous = None
        for block in blocks:
            if options.degree != "auto" and int(options.degree) * ep != block.num_experts:
                raise PlanError(_degree_misfit(block.num_experts, int(options.degree), plan))
            program.notes.append(_degree_note(program, block, plan, options.degree))
            previous = _pack_block(rw, block, ep, previous)
            program.runtime.expert_placement[block.path] = {
                "num_experts": block.num_experts,
                "ranks": ep,
                "weights": [block.gate_up, block.down],
                "replace_every": options.replace_every,
                "balance": options.balance,
                "payback": options.payback,
                "row_bytes": _row_round_trip_bytes(program, block),
            }
        rw.finish()
        return True


def _row_round_trip_bytes(program: Program, block: MoEBlock) -> int:
    """Bytes one (token, rank) row costs a step: its dispatch and combine rows, each way in
    forward and again as gradients in backward, at the experts' width and dtype (fp8
    dispatch rows at one byte an element). What a co-located selection saves, for the
    re-placement's payback."""
    down = program.gm.get_parameter(block.down)  # [experts, hidden, expert hidden]
    hidden, element = down.shape[1], down.element_size()
    dispatch_element = 1 if block.dispatch_codec == "fp8" else element
    return int(2 * hidden * (dispatch_element + element))


def _check_degree(plan: Plan, degree: str, model) -> None:
    try:
        value = int(degree)
    except ValueError:
        raise PlanError(f"pack_experts degree must be an integer >= 1 (experts per device) or 'auto', got {degree!r}") from None
    if value < 1:
        raise PlanError(f"pack_experts degree must be >= 1 (experts per device), got {value}")
    if model is None:
        return
    from .lift import find_experts_modules

    for path, module, pattern in find_experts_modules(model):
        if pattern is None:
            continue
        experts = next(p for p in module.parameters(recurse=False) if p.dim() == 3).shape[0]
        if value * plan.topology.expert_parallel_size != experts:
            raise PlanError(f"{path}: " + _degree_misfit(experts, value, plan))


def _degree_misfit(experts: int, degree: int, plan: Plan) -> str:
    world, ep = plan.topology.world_size, plan.topology.expert_parallel_size
    fits = [d for d in range(1, experts + 1) if experts % d == 0 and world % (experts // d) == 0]
    if experts % degree or world % (experts // degree):
        return (
            f"pack_experts degree={degree} does not fit: {experts} experts in groups of {degree} need an expert-parallel "
            f"group of {experts / degree:g} ranks, which must divide the world size {world}; degrees that fit: {fits}"
        )
    return (
        f"pack_experts degree={degree} means an expert-parallel group of {experts // degree} ranks, but the plan has "
        f"ep={ep} ({experts // ep} experts per device); pass --ep {experts // degree} (or degree={experts // ep})"
    )


def _degree_note(program: Program, block: MoEBlock, plan: Plan, degree: str) -> str:
    """What `commfx dump` says about the packing degree: the plan's, and the cost model's."""
    ep = plan.topology.expert_parallel_size
    here = f"pack_experts {block.path}: {block.num_experts // ep} experts per device (ep={ep}, degree={degree})"
    tokens = program.tokens_per_rank
    if not tokens:
        return here + "; the cost model needs the tokens per rank (compile through commfx.compile_program)"
    down, gate_up = program.gm.get_parameter(block.down), program.gm.get_parameter(block.gate_up)
    region = MoERegion(
        tokens=tokens, hidden=down.shape[1], expert_hidden=down.shape[2], top_k=block.top_k,
        num_experts=block.num_experts, dtype_bytes=down.element_size(), matrices=gate_up.shape[1] // down.shape[2] + 1,
    )
    choice = packing_degree(region, plan.topology, block.chunks)
    verdict = "the plan's" if choice.degree * ep == block.num_experts else f"to apply it: --ep {block.num_experts // choice.degree}"
    return here + f". Cost model recommends {choice.degree} ({verdict}): {choice.reason}"


def _pack_block(rw: Rewriter, block: MoEBlock, ep: int, previous: fx.Node | None) -> fx.Node:
    """Rewrite one block; returns its router's expert choices (the next block's `previous`)."""
    dispatch, (ffn,), combine = block.dispatch, block.experts, block.combine
    x, indices, capacity_factor = dispatch.args[0], dispatch.args[1], float(dispatch.args[3])
    weights = combine.args[2]
    local_experts = block.num_experts // ep
    old = _block_nodes(dispatch, combine)
    path = block.path
    make = rw.maker(ffn)

    with rw.before(combine):
        slots = make(commfx.expert_slots.default, (indices, previous, path, block.num_experts, ep), "where each expert lives now (runtime placement)")
        packed = make(commfx.rank_dispatch.default, (x, slots, weights, ep, local_experts, capacity_factor), "each token once per rank")
        rows, meta, row_token, send = (make(operator.getitem, (packed, i)) for i in range(4))
        recv_counts = make(commfx.exchange_counts.default, (send, "ep", ep), "exchange row counts")
        back, exchange = build_exchange(
            make, rows, meta, send, recv_counts, ffn.args[2:5], ep, local_experts, path, chunks=1, codec=block.dispatch_codec
        )
        result = make(commfx.scatter_add_tokens.default, (back, row_token, x), "sum ranks' rows into tokens")
    rw.replace(combine, result, erase=False)
    rw.erase_dead(old)
    block.dispatch, block.combine, block.exchange = packed, result, None
    block.experts = [n for n in exchange if n.target is commfx.packed_expert_ffn.default]
    block.packed = PackedExchange(rows, meta, send, recv_counts, exchange)
    return indices


def build_exchange(
    make, rows, meta, send, recv_counts, ffn_weights, ep: int, local_experts: int, path: str, chunks: int, codec: str = "rows"
):
    """dispatch all-to-alls -> local experts -> weighted sum -> combine all-to-all, in `chunks`
    pieces (each destination rank's rows cut into `chunks` runs, as `split_chunks` does, so
    the receiver derives its chunk counts from the counts it has); dispatch rows cross as
    `codec` says (dispatch_codec.py). Returns (the rows that came back, in `rows`' order;
    every node made)."""
    made: list[fx.Node] = []

    def node(target, args, purpose=None):
        made.append(make(target, args, purpose))
        return made[-1]

    gate_up, down, activation = ffn_weights
    send_counts = node(torch.ops.aten.view.default, (send, [ep, 1]), "rows per destination rank")
    if chunks == 1:
        pieces = [(rows, meta, send_counts, recv_counts, "")]
    else:
        send_chunks = node(commfx.chunk_counts.default, (send_counts, chunks), f"rows per rank in each of {chunks} chunks")
        recv_chunks = node(commfx.chunk_counts.default, (recv_counts, chunks), "the same, for the rows this rank receives")
        row_pieces = node(commfx.split_chunks.default, (rows, send, chunks), f"cut every rank's rows into {chunks} runs")
        meta_pieces = node(commfx.split_chunks.default, (meta, send, chunks))
        pieces = [
            (
                node(operator.getitem, (row_pieces, j)),
                node(operator.getitem, (meta_pieces, j)),
                node(torch.ops.aten.select.int, (send_chunks, 0, j)),
                node(torch.ops.aten.select.int, (recv_chunks, 0, j)),
                f" {j + 1}/{chunks}",
            )
            for j in range(chunks)
        ]
    # Every chunk's dispatch first, then each chunk's experts and combine (as partition_a2a
    # orders a plain block): the schedule pass keeps the starts' graph order, so chunk j+1's
    # rows are on the wire while chunk j's experts run.
    received = [
        dispatch_all_to_all(
            node, node(commfx.attach_meta.default, (rows_j, meta_j)), send_j, recv_j, "ep", "a2a", f"{path} packed dispatch{part}",
            codec, f"dispatch all-to-all: token rows with their routing weights and local ids{part}", meta=meta_j,
        )
        for rows_j, meta_j, send_j, recv_j, part in pieces
    ]
    backs = []
    for payload, (rows_j, meta_j, send_j, recv_j, part) in zip(received, pieces):
        split = node(commfx.detach_meta.default, (payload, meta_j))
        rows_in, row_weights, local_ids = (node(operator.getitem, (split, i)) for i in range(3))
        summed = node(
            commfx.packed_expert_ffn.default, (rows_in, local_ids, row_weights, gate_up, down, activation),
            f"local experts ({local_experts}) and their weighted sum, fused{part}",
        )
        backs.append(node(commfx.all_to_all.default, (summed, recv_j, send_j, "ep", "a2a", f"{path} packed combine{part}"), f"combine all-to-all, one row per (token, rank){part}"))
    if chunks == 1:
        return backs[0], made
    return node(commfx.merge_chunks.default, (backs, send, chunks), "rows back in dispatch order"), made


def _block_nodes(dispatch: fx.Node, combine: fx.Node) -> list[fx.Node]:
    """The nodes lift and expert_parallel made for one block (from its dispatch to its
    combine): stamped by them, or a getitem of one. Nothing the model wrote verbatim."""
    made_here = ("lift", "expert_parallel")
    region: list[fx.Node] = []
    inside = False
    for node in dispatch.graph.nodes:
        inside = inside or node is dispatch
        if inside:
            stamped = (node.meta.get("commfx") or {}).get("pass") in made_here
            part_of = node.target is operator.getitem and node.args[0] in region
            if stamped or part_of:
                region.append(node)
        if node is combine:
            break
    return region
