"""One rank's training step as the simulator replays it: compute, collective starts and
waits, and gradients becoming ready, read off a compiled `Program`.

The forward is the distributed graph in order. Each compute node costs FLOPs and bytes
from its traced shapes (`cost.flops`); the nodes passes made inside an MoE block have no
traced shapes, so their rows come from the block under uniform routing (each rank sends
T·top_k rows per layer split over k chunks; packed experts send a token once per device
that holds any of its experts). The backward is the forward mirrored: compute twice the
FLOPs (expert FFNs 8/3: they recompute their hidden layer), each all-to-all reversed (its
wait in the forward is where the backward starts it, and its start where the backward
waits), and each parameter's gradient ready once the backward passes its first use.
split_embedding_comm's row exchanges are sized, and under schedule=2d posted into the next
step, by `rows`.

Activations are every compute node's output (an upper bound on what the backward reads).
Under `Plan(activation_memory_budget=b)` the forward keeps about b of those bytes: the
nodes cheapest to recompute (fewest FLOPs per byte kept; never a commfx op, which the
partition saves, `compiler.remat`) are dropped until the rest fits, and the backward runs
each dropped node again just before its own gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..compiler.program import TP_PARTS, Program, module_path
from ..compiler.remat import recomputable
from ..cost.all_to_all import duplicate_share, reach_share
from ..cost.flops import hint, node_bytes, node_flops
from ..plan import DEFAULT_CLASS, Plan

FREE = {
    "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "getitem", "unbind", "detach", "expand", "sym_size",
    "size", "split", "chunk", "contiguous", "select", "unsqueeze", "squeeze", "flatten", "sym_size.int", "view.default",
    "attach_meta", "detach_meta", "chunk_counts", "mul", "floordiv", "sub", "add_int",
}
SPLIT_PHASE = {"all_to_all_start"}
A2A = {"all_to_all", "all_to_all_start", "embedding_all_to_all", "exchange_row_grads"}
SMALL_COMM = {"exchange_counts", "embedding_counts"}
ALL_REDUCE = {"all_reduce"}
BACKWARD_FACTOR = {"expert_ffn": 8 / 3, "packed_expert_ffn": 8 / 3}


@dataclass
class Comm:
    """One collective of one rank: what it moves and on which group and lane."""

    id: int
    kind: str  # all_to_all | all_reduce | send
    label: str  # what the trace shows (the scheduler's kind: all_to_all, grad_all_reduce, ...)
    group: str
    priority: str
    tag: str
    payload: float  # bytes this rank sends
    reversed_in_backward: bool = True  # an all-to-all waited in the forward: the backward sends its gradients back
    row_bytes: float = 0.0  # an MoE block's all-to-all: bytes of one row
    duplicate_share: float = 0.0  # of its off-node rows, those repeating one bound for the same node (a forward dispatch)


@dataclass
class Item:
    """One entry of a rank's step, in the order the executor meets it."""

    what: str  # compute | start | wait | grads | exchange (a collective only the backward makes)
    name: str
    phase: str  # forward | backward | optimizer
    label: str = ""
    flops: float = 0.0
    nbytes: float = 0.0
    comm: Comm | None = None
    comm_id: int = -1
    params: list[str] = field(default_factory=list)  # grads: ready now; forward: first read here
    backward: list["Item"] = field(default_factory=list)  # rows: what the backward runs in its place (simulate/rows.py)
    saved: float = 0.0  # forward compute: bytes of its output kept for the backward
    recomputable: bool = False  # forward compute: the partition may recompute it (not a commfx op)
    recompute: bool = False  # forward compute: dropped under the plan's budget, run again in the backward


@dataclass
class Workload:
    items: list[Item]
    params: dict[str, tuple[int, int, str | None]]  # name -> (numel on this rank, element size, reducing group or None)
    activation_bytes: float  # forward outputs kept for backward (an upper bound; under a budget, what it keeps)
    notes: list[str]
    recompute_flops: float = 0.0  # forward FLOPs the backward runs again (activation budget)


def _target(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[0] if name.endswith((".default", ".int", ".Tensor")) else name


def _tensor_bytes(value) -> float:
    if isinstance(value, torch.Tensor):
        return float(math.prod(hint(s) for s in value.shape) * value.element_size())
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0.0


def _value(node) -> object:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


class _Blocks:
    """Per MoE block: rows per chunk this rank sends and receives, its FLOPs per row."""

    def __init__(self, program: Program, plan: Plan, tokens: int, dtype_bytes: int):
        self.rows: dict[str, float] = {}
        self.flops_per_row: dict[str, float] = {}
        self.hidden: dict[str, int] = {}
        self.expert_nodes: dict[fx.Node, str] = {}
        self.duplicates: dict[str, float] = {}  # a forward dispatch's repeated off-node rows (cost.all_to_all)
        ep = plan.topology.expert_parallel_size
        nodes = len({plan.topology.node_of(r) for r in range(ep)})
        params = dict(program.gm.named_parameters())
        self.blocks = list(program.regions.moe_blocks)
        for block in self.blocks:
            gate_up, down = params.get(block.gate_up), params.get(block.down)
            experts = block.num_experts
            weights = (gate_up.numel() + down.numel()) / experts if gate_up is not None and down is not None else 0
            hidden = gate_up.shape[-1] if gate_up is not None else 0
            if block.packed is not None and ep > 1:
                rows = tokens * ep * reach_share(experts, block.top_k, ep)
            else:
                rows = tokens * block.top_k
            self.rows[block.path] = rows / max(block.chunks, 1)
            self.flops_per_row[block.path] = 2.0 * weights * (tokens * block.top_k / rows if rows else 1)
            self.hidden[block.path] = hidden * dtype_bytes
            # packed rows carry each rank's own routing weights and ids: none repeats
            self.duplicates[block.path] = 0.0 if block.packed is not None else duplicate_share(experts, block.top_k, nodes)
            for node in block.experts:
                self.expert_nodes[node] = block.path

    def of_tag(self, tag: str) -> str | None:
        found = [b.path for b in self.blocks if tag.startswith(b.path)]
        return max(found, key=len) if found else None

    def of_node(self, node: fx.Node) -> str | None:
        if node in self.expert_nodes:
            return self.expert_nodes[node]
        path = module_path(node) or ""
        found = [b.path for b in self.blocks if path.startswith(b.path)]
        return max(found, key=len) if found else None


def build_workload(program: Program, plan: Plan, tokens: int, scale: float = 1.0) -> Workload:
    """The step of one rank that sees `tokens` tokens (program compiled on that rank's batch).

    `scale`: the traced batch stands for `scale` times its rows (the MoE blocks already see
    `tokens`): costs read off traced shapes, which are linear in rows at a fixed sequence
    length, are multiplied by it; parameters' and gradients' bytes are not."""
    dtype_bytes = 2 if plan.precision == "bf16" else 4
    from .rows import RowTables

    blocks = _Blocks(program, plan, tokens, dtype_bytes)
    tables = RowTables(program)
    forward: list[Item] = []
    started: dict[fx.Node, Comm] = {}
    first_use: dict[str, int] = {}
    activation = 0.0
    notes: list[str] = []
    counter = iter(range(1 << 30))
    constant: set[fx.Node] = set()  # computed from parameters alone (casts of weights): not scaled by rows
    for node in program.graph.nodes:
        if node.op == "get_attr" or node.op in ("call_function", "call_method") and all(a in constant or a.op == "get_attr" for a in node.all_input_nodes):
            constant.add(node)
        if node.op == "get_attr":
            continue
        if node.op in ("placeholder", "output"):
            continue
        name = _target(node)
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                first_use.setdefault(str(arg.target), len(forward))
        if name == "wait_tensor" and node.args and node.args[0] in started:
            forward.append(Item("wait", node.name, "forward", comm_id=started[node.args[0]].id))
            continue
        rows = 1.0 if node in constant else scale
        forward += tables.before(node, name, counter, rows)  # schedule=2d: the table's rows of the step before
        comm = _comm_of(node, name, blocks, next(counter), rows)
        if comm is not None and name == "embedding_all_to_all":
            tables.size(comm, node, rows)
        if comm is not None:
            forward.append(Item("start", node.name, "forward", comm=comm))
            if name in SPLIT_PHASE:
                started[node] = comm
            else:
                forward.append(Item("wait", node.name, "forward", comm_id=comm.id))
            continue
        if name in FREE or node.op == "call_method" and name in FREE:
            continue
        flops, nbytes = _compute_cost(node, name, blocks, rows, constant)
        if flops or nbytes:
            saved = _tensor_bytes(_value(node)) * rows
            forward.append(Item("compute", node.name, "forward", label=_label(node), flops=flops, nbytes=nbytes, saved=saved,
                                recomputable=recomputable(node.target)))
            activation += saved
        if name == "sparse_grad_embedding":
            forward.append(_row_grad_exchange(node, next(counter), rows, tables))
        forward += tables.after(node, name, counter, rows)  # schedule=2d: its rows posted by the backward
    for param, index in first_use.items():  # the item that first reads a parameter (shard_states:stage=3 gathers it before)
        if index < len(forward):
            forward[index].params.append(param)
    recompute_flops = 0.0
    if plan.activation_memory_budget is not None and activation:
        kept = drop_activations(forward, plan.activation_memory_budget * activation)
        dropped = [i for i in forward if i.recompute]
        recompute_flops = sum(i.flops for i in dropped)
        notes.append(f"activation memory budget {plan.activation_memory_budget:g}: the forward keeps {kept / 1e6:.4g} of "
                     f"{activation / 1e6:.4g} MB of activations; the backward recomputes {len(dropped)} ops ({recompute_flops / 1e9:.4g} GFLOP)")
        activation = kept
    backward = _mirror(forward, counter, first_use)
    params = _parameters(program, plan)
    # AdamW reads and writes p, g, m, v; under shard_states each rank steps its shard only
    parts = {name: len(ranks[0]) for name, ranks in plan.topology.process_groups().items()} if program.runtime.shard_states else {}
    optimizer_bytes = sum(numel * size * 8 / parts.get(group, 1) for name, (numel, size, group) in params.items()
                          if name not in tables.deferred)  # a schedule=2d table is stepped at its next lookup
    items = forward + backward + [Item("compute", "optimizer.step", "optimizer", label="optimizer step", nbytes=optimizer_bytes)]
    if not blocks.blocks and any(i.comm and i.comm.payload == 0 for i in items):
        notes.append("some collectives could not be sized from the graph and count as latency only")
    return Workload(items, params, activation, notes, recompute_flops)


def drop_activations(forward: list[Item], keep_bytes: float) -> float:
    """Mark forward compute items to recompute, cheapest per byte first, until at most
    `keep_bytes` of activations are kept (or nothing recomputable is left); the bytes kept."""
    kept = sum(i.saved for i in forward)
    candidates = sorted((i for i in forward if i.what == "compute" and i.recomputable and i.saved > 0),
                        key=lambda i: (i.flops / i.saved, i.nbytes / i.saved))
    for item in candidates:
        if kept <= keep_bytes:
            break
        item.recompute = True
        kept -= item.saved
    return kept


def _comm_of(node: fx.Node, name: str, blocks: _Blocks, ident: int, scale: float = 1.0) -> Comm | None:
    if name in A2A:
        group, priority, tag = _comm_args(node)
        path = blocks.of_tag(tag) if tag else blocks.of_node(node)
        if not path:
            return Comm(ident, "all_to_all", "all_to_all", group, priority, tag, scale * _tensor_bytes(_value(node.args[0]) if node.args else None))
        words = tag[len(path):].split()  # "dispatch 1/2", "packed dispatch", "combine mb 1/2" (hierarchical_a2a names untagged ones)
        dispatch = words[:1] == ["dispatch"] or words[:2] == ["packed", "dispatch"]
        return Comm(ident, "all_to_all", "all_to_all", group, priority, tag, blocks.rows[path] * blocks.hidden[path],
                    row_bytes=blocks.hidden[path], duplicate_share=blocks.duplicates[path] if dispatch else 0.0)
    if name in SMALL_COMM:
        group = next((a for a in node.args if isinstance(a, str)), "ep")
        return Comm(ident, "all_to_all", "all_to_all", group, DEFAULT_CLASS, name, 64.0)
    if name in ALL_REDUCE:
        group = next((a for a in node.args[1:] if isinstance(a, str)), "tp")
        return Comm(ident, "all_reduce", "all_reduce", group, DEFAULT_CLASS, name, scale * _tensor_bytes(_value(node)))
    return None


def _row_grad_exchange(node: fx.Node, ident: int, scale: float, tables) -> Item:
    """split_embedding_comm's replicated-sparse table: its backward (`exchange_row_grads`)
    coalesces the rows' gradients per unique id and sends them, with their ids, to every rank
    of the group: one pair per row touched, at most one per token and one per table row
    (`rows.RowTables`, an upper bound)."""
    _, _, _, group, parts, _, priority = node.args
    value = _value(node)
    rows = scale * _tensor_bytes(value)
    row_bytes = hint(value.shape[-1]) * value.element_size()
    payload = parts * tables.pairs_bytes(node.args[0], rows / row_bytes, row_bytes)
    comm = Comm(ident, "all_to_all", "all_to_all", group, priority, "embedding row grads", payload)
    return Item("exchange", node.name, "forward", label="exchange_row_grads", nbytes=3 * rows, comm=comm)


def _comm_args(node: fx.Node) -> tuple[str, str, str]:
    strings = [a for a in node.args if isinstance(a, str)]
    group = strings[0] if strings else "ep"
    priority = strings[1] if len(strings) > 1 else DEFAULT_CLASS
    tag = strings[2] if len(strings) > 2 else ""
    return group, priority, tag


def _compute_cost(node: fx.Node, name: str, blocks: _Blocks, scale: float = 1.0, constant: frozenset | set = frozenset()) -> tuple[float, float]:
    """(FLOPs, bytes) of one compute node: traced shapes times `scale`, except inputs computed
    from parameters alone (`constant`: a weight and its casts), whose bytes do not grow with rows."""
    value = _value(node)
    path = blocks.of_node(node)
    if name in ("expert_ffn", "packed_expert_ffn") and path:
        rows = blocks.rows[path]
        return rows * blocks.flops_per_row[path], 3 * rows * blocks.hidden[path]
    if value is None and path and node.op == "call_function":  # a row op a pass made inside the block
        return 0.0, 2 * blocks.rows[path] * blocks.hidden[path]
    if not isinstance(value, (torch.Tensor, tuple, list)):  # a pass's op without a traced value (the sharded head)
        return scale * node_flops(node), scale * node_bytes(node)
    inputs = sum(_tensor_bytes(_value(a)) for a in node.all_input_nodes if a.op != "get_attr" and a not in constant)
    weights = sum(_tensor_bytes(_value(a)) or _tensor_bytes(getattr(a, "_param", None)) for a in node.all_input_nodes if a.op == "get_attr" or a in constant)
    parts = node.meta.get(TP_PARTS, 1)  # tensor_parallel: this rank's share of a value traced whole
    return scale * node_flops(node) / parts, (scale * (inputs + _tensor_bytes(value)) + weights) / parts


def _label(node: fx.Node) -> str:
    from ..runtime.trace import op_label

    return op_label(node)


def _mirror(forward: list[Item], counter, first_use: dict[str, int]) -> list[Item]:
    """The backward: forward reversed, compute doubled (a recomputed forward op first runs
    again), all-to-alls reversed, grads ready."""
    ready_after: dict[int, list[str]] = {}
    for param, index in first_use.items():
        ready_after.setdefault(index, []).append(param)
    reverse: dict[int, Comm] = {}
    backward: list[Item] = []
    for index in range(len(forward) - 1, -1, -1):
        item = forward[index]
        if item.what == "compute":
            if item.recompute:
                backward.append(Item("compute", item.name, "backward", label=f"{item.label} (recompute)", flops=item.flops, nbytes=item.nbytes))
            factor = BACKWARD_FACTOR.get(item.label.split(".")[-1], 2.0)
            backward.append(Item("compute", item.name, "backward", label=item.label, flops=factor * item.flops, nbytes=2 * item.nbytes))
        elif item.what == "exchange":  # a backward-only exchange: coalesce, send, wait
            backward += [Item("compute", item.name, "backward", label=item.label, nbytes=item.nbytes),
                         Item("start", item.name, "backward", comm=item.comm), Item("wait", item.name, "backward", comm_id=item.comm.id)]
        elif item.what == "rows":  # schedule=2d: coalesce, then post the rows into the next step
            backward += item.backward
        elif item.what == "wait":
            comm = _find_comm(forward, item.comm_id)
            if comm.kind == "all_to_all" and comm.payload > 64 and comm.reversed_in_backward:
                bw = Comm(next(counter), comm.kind, comm.label, comm.group, comm.priority, f"{comm.tag} (bw)", comm.payload,
                          row_bytes=comm.row_bytes)  # gradients of distinct rows: nothing repeats
                reverse[comm.id] = bw
                backward.append(Item("start", item.name, "backward", comm=bw))
        elif item.what == "start" and item.comm.id in reverse:
            backward.append(Item("wait", item.name, "backward", comm_id=reverse[item.comm.id].id))
        if index in ready_after:
            backward.append(Item("grads", f"grads@{item.name}", "backward", params=ready_after[index]))
    if -1 in ready_after:
        backward.append(Item("grads", "grads", "backward", params=ready_after[-1]))
    return backward


def _find_comm(items: list[Item], ident: int) -> Comm:
    return next(i.comm for i in items if i.what == "start" and i.comm.id == ident)


def _parameters(program: Program, plan: Plan) -> dict[str, tuple[int, int, str | None]]:
    """Each parameter's numel on one rank, its element size, and the group that reduces its gradient."""
    groups = plan.topology.process_groups()
    size = {name: len(g[0]) for name, g in groups.items()}
    out = {}
    for name, param in program.gm.named_parameters():
        shard = program.runtime.shards.get(name)
        numel = param.numel() // (shard["parts"] if shard else 1)
        group = shard.get("replicated_over") if shard else "dp"
        if name in program.runtime.reduced_in_graph or not param.requires_grad or group is None or size.get(group, 1) <= 1:
            group = None
        out[name] = (numel, param.element_size(), group)
    return out
