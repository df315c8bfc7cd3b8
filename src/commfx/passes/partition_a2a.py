"""partition_a2a: split each MoE region into k token chunks and prioritise all-to-all (Lina).

All-to-all blocks compute (experts wait for tokens; the next layer waits for them to come
back) while gradient all-reduce does not. Cutting the region into chunks lets chunk i's
transfer overlap chunk i±1's experts; giving all-to-all the higher priority class and
cutting gradient all-reduce into small chunks means a waiting all-to-all is delayed by at
most one chunk. (Li et al., "Accelerating Distributed MoE Training and Inference with
Lina", USENIX ATC 2023.)

The graph of one region after expert_parallel,

    rows -> all_to_all -> group_by_expert -> expert_ffn -> group_by_expert⁻¹ -> all_to_all -> combine

becomes k copies of the middle on `split_chunks(rows)` (every expert's rows cut into k
runs, so uneven splits and experts empty on some rank stay exact), joined by
`merge_chunks` before combine. The receiver derives chunk counts from the counts it
already has, so no extra count exchange. Both all-to-alls are tagged with their priority
class and chunk; the backward graph inherits both through autograd. The runtime side
(priority lanes, chunked gradient all-reduce) reads `program.runtime.comm_schedule`.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ..cost.moe import MoERegion, choose_chunks, grad_chunk_bytes, host_chunk_overhead
from ..plan import Plan, PlanError
from ..compiler.program import CommSchedule, Program, stamp
from ..compiler.regions import MoEBlock
from ..compiler.rewrite import Rewriter
from .base import Pass, PassError, plan_micro_batches, register
from .dispatch_codec import dispatch_all_to_all, retag
from .pack_experts import build_exchange

commfx = torch.ops.commfx
PASS = "partition_a2a"


@register(PASS, rewrites="moe_blocks", requires="expert parallel", ensures="all-to-all partitioned")
class PartitionA2A(Pass):
    """Chunk MoE all-to-alls so they overlap the experts; all-to-all before all-reduce.

    (Lina, USENIX ATC 2023.)
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        k: str = "auto"  # chunks per region: an integer >= 1, or auto (cost model)
        max_k: int = 8  # the largest k auto may pick
        priority: bool = True  # all-to-all pre-empts gradient all-reduce between chunks
        # gradient all-reduce chunk, the pre-emption granularity: bytes, or auto (latency <= 10% of a chunk)
        grad_chunk_bytes: str = "auto"

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        _int_or_auto("k", options.k, 1, "k must be >= 1")
        if options.max_k < 1:
            raise PlanError(f"partition_a2a max_k must be >= 1, got {options.max_k}")
        _int_or_auto(
            "grad_chunk_bytes", options.grad_chunk_bytes, 1024,
            "grad_chunk_bytes is too small: every chunk is one collective with its own latency; use 1024 or more, or auto",
        )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        blocks = program.regions.moe_blocks
        rw = Rewriter(program, PASS)
        tokens = program.tokens_per_rank
        for block in blocks:
            chunks = self.chunks_for(program, block, options, plan)
            if tokens is not None and options.k != "auto" and chunks > max(1, tokens):
                raise PlanError(
                    f"partition_a2a k={chunks} is more chunks than the {tokens} tokens per rank of {block.path}; "
                    f"use k <= {tokens} or k=auto"
                )
            if block.exchange is None and block.packed is None:
                raise PassError(f"partition_a2a: {block.path} has no expert-parallel exchange to cut; run expert_parallel before it")
            block.chunks = chunks
            if block.packed is not None:
                _partition_packed_block(rw, block, chunks)
            else:
                _partition_block(rw, block, chunks)
        chunk = grad_chunk_bytes(plan.topology) if options.grad_chunk_bytes == "auto" else int(options.grad_chunk_bytes)
        program.runtime.comm_schedule = CommSchedule(options.priority, chunk if options.priority else 0)
        chosen = sorted({block.chunks for block in blocks})
        program.notes.append(
            f"{PASS}: k={'/'.join(map(str, chosen))} chunks per all-to-all in {len(blocks)} MoE region(s)"
            + (" (k=auto: the cost model's choice from the topology's figures)" if options.k == "auto" else "")
            + f"; gradient chunks of {chunk:,} bytes")
        rw.finish()
        return bool(blocks)

    @staticmethod
    def chunks_for(program: Program, block: MoEBlock, options: Options, plan: Plan) -> int:
        if options.k != "auto":
            return int(options.k)
        tokens = program.tokens_per_rank
        if tokens is None:
            raise PassError("partition_a2a k=auto needs the tokens per rank (compile through commfx.compile_program)")
        down = program.gm.get_parameter(block.down)
        gate_up = program.gm.get_parameter(block.gate_up)
        hidden, expert_hidden = down.shape[1], down.shape[2]
        region = MoERegion(
            tokens=max(1, tokens // plan_micro_batches(plan)),  # each micro-batch runs the region once
            hidden=hidden,
            expert_hidden=expert_hidden,
            top_k=block.top_k,
            num_experts=block.num_experts,
            dtype_bytes=down.element_size(),
            matrices=gate_up.shape[1] // expert_hidden + 1,
        )
        overhead = plan.topology.chunk_overhead_s or host_chunk_overhead(down.device.type)
        return choose_chunks(region, plan.topology, max_k=options.max_k, chunk_overhead_s=overhead)


def _int_or_auto(name: str, value: str, minimum: int, too_small: str) -> None:
    if value == "auto":
        return
    try:
        number = int(value)
    except ValueError:
        raise PlanError(f"partition_a2a {name} must be an integer >= {minimum} or 'auto', got {value!r}") from None
    if number < minimum:
        raise PlanError(f"partition_a2a {too_small} (got {number})")


def _partition_block(rw: Rewriter, block: MoEBlock, chunks: int) -> None:
    ex, path = block.exchange, block.path
    if chunks == 1:  # nothing to split: name the collectives and give them their class
        for node, role in ((ex.received, "dispatch"), (ex.returned, "combine")):
            retag(node, "a2a", f"{path} {role} 1/1")
            stamp(node, PASS, f"{role} all-to-all (priority a2a, 1 chunk)")
        return
    (ffn,) = block.experts
    _, _, gate_up, down, activation = ffn.args
    group = ex.returned.args[3]
    ep, local_experts = ex.send_counts.args[1]
    make = rw.maker(ffn)

    with rw.before(ex.received):
        send_chunks = make(commfx.chunk_counts.default, (ex.counts, chunks), f"rows per expert in each of {chunks} chunks")
        recv_chunks = make(commfx.chunk_counts.default, (ex.recv_counts, chunks), "the same, for the rows this rank receives")
        pieces = make(commfx.split_chunks.default, (ex.rows, ex.counts, chunks), f"cut every expert's rows into {chunks} runs")
        sends, recvs, received = [], [], []
        for j in range(chunks):
            rows_j = make(operator.getitem, (pieces, j))
            send_j = make(torch.ops.aten.view.default, (make(torch.ops.aten.select.int, (send_chunks, 0, j)), [ep, local_experts]))
            recv_j = make(torch.ops.aten.select.int, (recv_chunks, 0, j))
            tag = f"{path} dispatch {j + 1}/{chunks}"
            purpose = f"dispatch all-to-all, chunk {j + 1}/{chunks} (priority a2a)"
            received.append(dispatch_all_to_all(make, rows_j, send_j, recv_j, group, "a2a", tag, block.dispatch_codec, purpose))
            sends.append(send_j)
            recvs.append(recv_j)
        returned, ffns = [], []
        for j in range(chunks):
            local_rows = make(commfx.group_by_expert.default, (received[j], recvs[j], False))
            local_counts = make(torch.ops.aten.sum.dim_IntList, (recvs[j], [0]))
            out = make(commfx.expert_ffn.default, (local_rows, local_counts, gate_up, down, activation), f"local experts, chunk {j + 1}/{chunks}")
            ffns.append(out)
            back = make(commfx.group_by_expert.default, (out, recvs[j], True))
            tag = f"{path} combine {j + 1}/{chunks}"
            returned.append(make(commfx.all_to_all.default, (back, recvs[j], sends[j], group, "a2a", tag), f"combine all-to-all, chunk {j + 1}/{chunks} (priority a2a)"))
        merged = make(commfx.merge_chunks.default, (returned, ex.counts, chunks), "rows back in dispatch order")
    old = ex.nodes()
    # under fp8, the received rows' decode reads an all-to-all of bytes that reads an encode
    wire = [ex.received.args[0], ex.received.args[0].args[0]] if block.dispatch_codec == "fp8" else []
    rw.replace(ex.returned, merged, erase=False)
    rw.erase(old[0], old[1], ffn, *old[2:], *wire)
    block.experts, block.exchange = ffns, None


def _partition_packed_block(rw: Rewriter, block: MoEBlock, chunks: int) -> None:
    """A block pack_experts rewrote: rebuild its exchange (dispatch all-to-alls, local experts,
    weighted sum, combine all-to-all) in `chunks` pieces, each destination rank's token rows
    cut into `chunks` runs."""
    packed, (ffn,) = block.packed, block.experts
    ep = packed.recv_counts.args[2]
    if chunks == 1:  # the packed exchange is one chunk already (its all-to-alls are class a2a)
        return
    with rw.before(packed.nodes[0]):
        back, made = build_exchange(
            rw.maker(ffn), packed.rows, packed.meta, packed.send, packed.recv_counts, ffn.args[3:6], ep,
            block.num_experts // ep, block.path, chunks, block.dispatch_codec,
        )
    old = list(packed.nodes)
    rw.replace(old[-1], back, erase=False)
    rw.erase(*reversed(old))
    block.experts = [n for n in made if n.target is commfx.packed_expert_ffn.default]
    packed.nodes = made
