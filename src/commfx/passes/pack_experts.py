"""pack_experts: send each token once per destination rank (Lina's expert packing, step one).

Plain expert parallelism sends one row per (token, expert): a top-2 token whose experts share
a rank crosses the wire twice each way. After this pass a token goes to each rank at most once
with its routing weights and the local ids of the experts it needs there (DeepEP's
`is_token_in_rank` layout); the expert rank runs them and sums their weighted outputs, and
one row comes back. Rows on the wire are the unique (token, destination rank) pairs. Each
expert-parallel block

    dispatch -> all_to_all -> experts -> all_to_all -> combine (at the source)

becomes

    rank_dispatch -> all_to_all(rows), all_to_all(weights + ids) -> masked_dispatch -> experts
                  -> moe_combine (at the expert rank) -> all_to_all -> scatter_add_tokens

Lossless: the same sums as expert parallelism, in another grouping (tested in float64).
Placement stays expert_parallel's (experts [r*E/ep, (r+1)*E/ep) on rank r); placement by
affinity, the packing degree and the fused kernel are the rest of Lina's idea, still to come.
(Lina, USENIX ATC 2023; DeepEP's dispatch layout.)
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..compiler.program import Program, stamp
from ..plan import Plan, PlanError
from .base import Pass, PassError, register
from .lift import erase_replaced

commfx = torch.ops.commfx
PASS = "pack_experts"


@register
class PackExperts(Pass):
    """Send each token once per destination rank; the expert rank combines its experts.

    (Lina, USENIX ATC 2023.)
    """

    name = PASS
    requires = ("expert parallel",)
    ensures = ("experts packed",)
    requires_passes = ("lift", "expert_parallel")

    @dataclasses.dataclass(frozen=True)
    class Options:
        pass

    @classmethod
    def applies(cls, program: Program) -> bool:
        return bool(program.annotations.get("moe_blocks"))

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model: torch.nn.Module | None) -> None:
        names = plan.pass_names()
        if "partition_a2a" in names:
            raise PlanError(
                "pack_experts does not compose with partition_a2a yet (chunking the packed dispatch is still to "
                "come); use one of them: --passes lift,expert_parallel,pack_experts"
            )
        capacity = plan.spec_for("expert_parallel").options.get("capacity_factor", 0)
        if float(capacity) > 0:
            raise PlanError(
                f"pack_experts needs dropless expert parallelism, but expert_parallel has capacity_factor={capacity}; "
                "drop the option (capacity mode drops per expert, which a packed row cannot express yet)"
            )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        blocks = program.annotations.get("moe_blocks") or []
        if not blocks:
            raise PassError("pack_experts found no expert-parallel MoE block in the graph")
        ep = plan.topology.expert_parallel_size
        nodes = {n.name: n for n in program.graph.nodes}
        for block in blocks:
            _pack_block(program.graph, nodes, block, ep)
        program.gm.recompile()
        return True


def _pack_block(graph: fx.Graph, nodes: dict[str, fx.Node], block: dict, ep: int) -> None:
    dispatch, ffn, combine = nodes[block["dispatch"]], nodes[block["expert_ffn"]], nodes[block["combine"]]
    if ffn.target is not commfx.expert_ffn.default or combine.target is not commfx.moe_combine.default:
        raise PassError(f"{block['path']}: pack_experts expects expert_parallel's block (dispatch, experts, combine)")
    x, indices = dispatch.args[0], dispatch.args[1]
    weights = combine.args[2]
    gate_up, down, activation = ffn.args[2], ffn.args[3], ffn.args[4]
    local_experts = block["num_experts"] // ep
    old = _block_nodes(dispatch, combine)
    stack = dict(ffn.meta.get("nn_module_stack", {}))
    path = block["path"]

    def make(target, args, purpose=None):
        node = graph.call_function(target, args)
        node.meta["nn_module_stack"] = stack
        return stamp(node, PASS, purpose) if purpose else node

    with graph.inserting_before(combine):
        packed = make(commfx.rank_dispatch.default, (x, indices, weights, ep, local_experts), "each token once per rank")
        rows, meta, row_token, send = (make(operator.getitem, (packed, i)) for i in range(4))
        send_counts = make(torch.ops.aten.view.default, (send, [ep, 1]), "rows per destination rank")
        recv_counts = make(commfx.exchange_counts.default, (send, "ep", ep), "exchange row counts")
        received = make(
            commfx.all_to_all.default, (rows, send_counts, recv_counts, "ep", "a2a", f"{path} packed dispatch"), "dispatch all-to-all, token rows"
        )
        received_meta = make(
            commfx.all_to_all.default, (meta, send_counts, recv_counts, "ep", "a2a", f"{path} packed routing"), "routing weights and local ids"
        )
        split = make(commfx.split_meta.default, (received_meta,))
        row_weights, local_ids = make(operator.getitem, (split, 0)), make(operator.getitem, (split, 1))
        laid = make(commfx.masked_dispatch.default, (received, local_ids, local_experts), "fan out to local experts")
        expert_rows, counts, slot = (make(operator.getitem, (laid, i)) for i in range(3))
        experts = make(commfx.expert_ffn.default, (expert_rows, counts, gate_up, down, activation), f"local experts ({local_experts})")
        summed = make(commfx.moe_combine.default, (experts, slot, row_weights), "weighted sum at the expert rank")
        back = make(
            commfx.all_to_all.default, (summed, recv_counts, send_counts, "ep", "a2a", f"{path} packed combine"), "combine all-to-all, one row per (token, rank)"
        )
        result = make(commfx.scatter_add_tokens.default, (back, row_token, x), "sum ranks' rows into tokens")
    combine.replace_all_uses_with(result)
    erase_replaced(graph, old)
    block.update(dispatch=packed.name, expert_ffn=experts.name, combine=result.name, packed=True)


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
