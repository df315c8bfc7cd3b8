"""locality_gate: route tokens to experts on their own node (LocMoE, IJCAI 2024).

LocMoE turns inter-node all-to-all into intra-node traffic by a gate that prefers the
token's node while staying balanced. This pass substitutes each lifted `topk_router`:

- the scores: the model's own softmax (`gate=model`), LocMoE's fixed GrAP gate
  (`gate=grap`), or the baselines LocMoE compares with, without locality: switch (top-1 of
  the model's router, `gate=switch`) and hash (a fixed hash of the token id, `gate=hash`);
- the choice (hard locality): each token's experts on at most `max_nodes` nodes, chosen by
  the summed top scores per node (DeepSeek-V3), and at most `max_remote_fraction` of the
  tokens off their node (FastMoE's FasterGate); both hold from the first step; and no expert
  over `balance` x its node's mean rows (a token falls back to its next allowed expert);
- the losses (soft locality): alpha * E * sum f_i P_i and mu * KL(p_node || node-local), sent
  into backward by an identity op, so outputs do not change (`ops/locality.py`);
- the capacity (capacity mode, `expert_parallel:capacity_factor>0`): LocMoE's floor
  1 / (n (1 - I_{δ²}(½, (d-1)/2))), δ the mean |cos| between each token and its experts'
  gate vectors measured on every batch, raises the configured factor: the dispatch uses
  max(floor, configured) (as a factor: n x floor, 1 = the even share).

The defaults depend on the router's top-k (`default_remote_fraction`; `commfx dump` notes the
choice per layer). Both use the model's scores, <= 2 nodes per token and balance 1.2, from the
first step:
- top-1 (LocMoE's own setting): at most 20% of a rank's tokens leave its node. Chosen from the
  like-for-like top-1 table (benchmarks/RESULTS.md, LocMoE): on gpt-moe at 2 x 1 it gives 0.39x
  a switch router's inter-node all-to-all bytes, a step 0.58x switch's and hash's, load
  max/mean 1.19 and final loss +0.3% over 3 seeds; 30% gave 0.59x the bytes;
- top-2 and up: 30%, as measured against plain top-2 on the toy gpt-moe (0.41x inter-node
  bytes, load max/mean 1.22, final loss +0.9%; benchmarks/log/notebook-2026-11.md). At real
  proportions it costs more loss: +3.5% at Mixtral's top-2 (+2.1% at 50%), +6.1% at Qwen3's
  top-8 (benchmarks/RESULTS.md, LocMoE), for 0.35x and 0.27x the bytes across nodes.
Lossy: it changes which experts run.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.commfx)
from ..compiler.program import Program
from ..compiler.regions import MoEBlock
from ..compiler.rewrite import Pattern, Rewriter
from ..ops import locality
from ..plan import Plan, PlanError, Topology
from .base import Pass, PassError, plan_capacity_factor, register
from .lift import find_experts_modules

commfx = torch.ops.commfx
PASS = "locality_gate"
GATES = ("model", "grap", "switch", "hash")
BASELINES = ("switch", "hash")  # top-1, no locality
# max_remote_fraction when the plan leaves it unset, by the router's top-k (see the docstring)
REMOTE_FRACTION_TOP1 = 0.2
REMOTE_FRACTION_TOPK = 0.3


def default_remote_fraction(k: int) -> float:
    """The off-node share a router picking `k` experts gets by default: 0.2 for top-1, 0.3 above."""
    return REMOTE_FRACTION_TOP1 if k == 1 else REMOTE_FRACTION_TOPK


def expert_nodes(topology: Topology, num_experts: int) -> tuple[list[int], list[int]]:
    """(node of each expert, node of each expert-parallel index); experts [r E/ep, (r+1) E/ep) on index r."""
    ep = topology.expert_parallel_size
    rank_node = [topology.node_of(i) for i in range(ep)]
    first = rank_node[0]
    rank_node = [n - first for n in rank_node]
    return [rank_node[e // (num_experts // ep)] for e in range(num_experts)], rank_node


def router_probs(raw: torch.Tensor, score_dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(raw.to(score_dtype), dim=-1)


def routing_weights(probs: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The chosen experts' probabilities (renormalised like the model's router), differentiable."""
    picked = probs.gather(-1, indices)
    return picked / picked.sum(-1, keepdim=True) if normalize else picked


@register(PASS, rewrites="moe_blocks", requires="moe lifted", ensures="locality gate")
class LocalityGate(Pass):
    """Node-local top-k routing with balance and locality losses (LocMoE; DeepSeek-V3 node limit)."""

    @dataclasses.dataclass(frozen=True)
    class Options:
        gate: str = "model"  # model | grap | switch | hash
        max_nodes: int = 2  # each token's experts on at most this many nodes (0: no limit)
        max_remote_fraction: float | None = None  # at most this fraction of a rank's tokens leaves its node (1: no cap; unset: by top-k)
        alpha: float = 0.01  # load-balancing loss weight (0: off)
        mu: float = 0.01  # locality loss weight (0: off)
        balance: float = 1.2  # no expert takes more than this x its node's mean rows (0: off; balanced_topk)

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.gate not in GATES:
            raise PlanError(f"locality_gate gate={options.gate!r} is not one of {', '.join(GATES)}")
        if options.max_remote_fraction is not None and not 0.0 <= options.max_remote_fraction <= 1.0:
            raise PlanError(f"locality_gate max_remote_fraction must be in [0, 1], got {options.max_remote_fraction}")
        if options.max_nodes < 0 or options.alpha < 0 or options.mu < 0:
            raise PlanError("locality_gate max_nodes, alpha and mu must be >= 0")
        if options.balance and options.balance < 1:
            raise PlanError(f"locality_gate balance={options.balance:g} caps experts below their mean load, which no routing can meet; use >= 1 (0: off)")
        topology = plan.topology
        nodes = len(set(expert_nodes(topology, topology.expert_parallel_size)[1]))
        if options.gate not in BASELINES and nodes < 2:
            raise PlanError(
                "locality_gate routes by node, but this plan has "
                + ("no nodes (ranks_per_node is 0: every rank on one node)" if not topology.ranks_per_node else f"one node holding all ep={topology.expert_parallel_size} ranks")
                + "; set --ranks-per-node (Topology(ranks_per_node=...)) below the expert-parallel size"
            )
        if options.gate not in BASELINES and options.max_nodes > nodes:
            raise PlanError(
                f"locality_gate max_nodes={options.max_nodes} is larger than the {nodes} nodes the expert-parallel group spans; "
                f"choose max_nodes from 1..{nodes} (0: no limit)"
            )
        if model is None:
            return
        for path, module, pattern in find_experts_modules(model):
            if pattern is None:
                continue
            num_experts, _, hidden = getattr(module, pattern.gate_up).shape
            if options.gate == "grap" and hidden % num_experts:
                raise PlanError(
                    f"locality_gate gate=grap splits {path}'s hidden size {hidden} into {num_experts} groups (one per expert), "
                    f"but {hidden} is not divisible by {num_experts}; use gate=model, or a hidden size that is a multiple of {num_experts}"
                )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        rw = Rewriter(program, PASS)
        changed = False
        for block in program.regions.moe_blocks:
            dispatch = block.dispatch
            router, picks = _lifted_router(dispatch.args[1])
            if router is None:
                raise PassError(
                    f"locality_gate: the router of {block.path} was not lifted to commfx.topk_router "
                    "(lift keeps group-limited, sigmoid and biased routers verbatim); drop locality_gate for this model"
                )
            fraction = _substitute(rw, router, picks, dispatch, block, options, plan)
            program.decisions.setdefault(PASS, {})[block.path] = {"gate": options.gate, "top_k": block.top_k, "max_remote_fraction": fraction}
            changed = True
        program.notes.extend(_default_notes(program.decisions.get(PASS, {}), options))
        rw.finish()
        return changed


# The expert choices lift's topk_router makes: getitem(topk_router(...), i).
LIFTED_PICK = Pattern(operator.getitem, args=(Pattern(commfx.topk_router.default, name="router"),))


def _lifted_router(indices: fx.Node):
    """(topk_router node, {0: weights getitem, 1: indices getitem}) feeding a dispatch, or (None, None)."""
    found = LIFTED_PICK.match(indices)
    if found is None:
        return None, None
    router = found["router"]
    return router, {u.args[1]: u for u in router.users if u.target is operator.getitem}


def _default_notes(decisions: dict, options) -> list[str]:
    """One `commfx dump` note per distinct default the plan left to the pass (none when set)."""
    if options.max_remote_fraction is not None or options.gate in BASELINES:
        return []
    by_k: dict[int, list[str]] = {}
    for path, d in decisions.items():
        by_k.setdefault(d["top_k"], []).append(path)
    return [
        f"{PASS}: top-{k} router ({len(paths)} layer{'s' if len(paths) > 1 else ''}): max_remote_fraction="
        f"{default_remote_fraction(k):g} by default ({'top-1: LocMoE table, RESULTS.md' if k == 1 else 'top-k >= 2: as before'}); "
        "set it to override"
        for k, paths in sorted(by_k.items())
    ]


def _substitute(rw: Rewriter, router: fx.Node, picks: dict, dispatch: fx.Node, block: MoEBlock, options, plan: Plan) -> float:
    graph = rw.graph
    logits, k, normalize, score_dtype = router.args
    x = dispatch.args[0]
    num_experts = block.num_experts
    if plan.topology.expert_parallel_size > num_experts:
        raise PassError(f"{block.path}: {num_experts} experts over ep={plan.topology.expert_parallel_size}")
    expert_node, rank_node = expert_nodes(plan.topology, num_experts)
    num_nodes = len(set(rank_node))
    per_node = num_experts // num_nodes
    switch = options.gate in BASELINES
    k_used = 1 if switch else k
    max_nodes = num_nodes if switch or options.max_nodes == 0 else options.max_nodes
    chosen_by_default = options.max_remote_fraction is None and not switch
    fraction = 1.0 if switch else (default_remote_fraction(k) if chosen_by_default else options.max_remote_fraction)
    if max_nodes * per_node < k_used or (fraction < 1.0 and per_node < k_used):
        raise PassError(
            f"locality_gate: {block.path} picks {k_used} experts but a node holds {per_node}; "
            f"{'max_nodes=' + str(max_nodes) if max_nodes * per_node < k_used else 'tokens kept home'} cannot hold them. "
            "Raise max_nodes (or max_remote_fraction=1), or use fewer ranks per node"
        )
    make = rw.maker(router)

    if options.gate == "grap" and _position(graph, x) > _position(graph, router):
        raise PassError(f"locality_gate: {block.path}'s hidden states are computed after its router; GrAP cannot use them")
    token_ids = _token_ids(graph, block) if options.gate == "hash" else None
    configured = plan_capacity_factor(plan)
    gate_weight = None
    if configured > 0 and options.gate in ("model", "switch"):
        gate_weight = _router_weight(logits)
        if gate_weight is None:
            raise PassError(
                f"locality_gate: the capacity floor measures the angle between tokens and {block.path}'s router "
                "weights, but its logits do not come from a linear layer of a parameter; use gate=grap, "
                "or dropless expert parallelism (capacity_factor=0)"
            )
    with rw.before(router.next):  # in order (inserting_after would reverse them)
        raw = make(locality.grap_scores, (x, num_experts), "GrAP gate: relu(mean of d/E groups)") if options.gate == "grap" else logits
        probs = make(router_probs, (raw, score_dtype), "router probabilities")
        if options.gate == "hash":
            indices = make(locality.hash_route, (token_ids, probs, num_experts), "hash routing: a fixed hash of the token id")
        else:
            home = make(commfx.home_experts.default, (probs, expert_node, rank_node, "ep"), "experts on this rank's node")
            chosen = make("detach", (probs,), op="call_method")
            balance = 0.0 if switch else float(options.balance)
            purpose = "switch top-1" if switch else (
                f"top-{k} on <= {max_nodes} node(s), <= {fraction:g} of tokens off-node"
                + (f", <= {balance:g} x node mean rows per expert" if balance else "")
            )
            indices = make(commfx.locality_topk.default, (chosen, home, k_used, expert_node, max_nodes, fraction, balance), purpose)
        weights = make(routing_weights, (probs, indices, normalize), "chosen experts' weights")
        if configured > 0 and options.gate != "hash":
            tokens = make("detach", (x,), op="call_method")
            gate = make("detach", (gate_weight,), op="call_method") if gate_weight is not None else None
            floor = make(
                commfx.measure_capacity_floor.default,
                (tokens, gate, indices, num_experts, configured, block.path),
                f"capacity = max(LocMoE floor 1/(n(1-I_δ²(1/2,(d-1)/2))) as a factor, n={num_experts}, δ from the batch; "
                f"configured {configured:g})",
            )
            dispatch.kwargs = {**dispatch.kwargs, "capacity_floor": floor}
        if options.gate != "hash" and (options.alpha or options.mu):
            losses = make(locality.aux_losses, (probs, indices, home, expert_node, options.alpha, options.mu), f"balance (alpha={options.alpha:g}) and locality (mu={options.mu:g}) losses")
            weights = make(commfx.add_aux_loss.default, (weights, losses, block.path), "identity; backward adds the losses' gradient")
    old_weights, old_indices = picks.get(0), picks.get(1)
    _copy_value(indices, old_indices, k_used)
    _copy_value(weights, old_weights, k_used)
    if old_weights is not None:
        rw.replace(old_weights, weights, erase=False)
    rw.replace(old_indices, indices, erase=False)
    for node in (old_weights, old_indices, router):
        if node is not None and not node.users:
            rw.erase(node)
    block.top_k, block.gate = k_used, options.gate
    return fraction


def _router_weight(logits: fx.Node) -> fx.Node | None:
    """The parameter whose rows are the gate vectors: logits = linear(x, W) (+ bias), else None."""
    node = logits
    while node.target is operator.add and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if node.target in (torch.nn.functional.linear, torch.ops.aten.linear.default) and len(node.args) > 1:
        weight = node.args[1]
        if isinstance(weight, fx.Node) and weight.op in ("get_attr", "placeholder"):
            return weight
    return None


def _token_ids(graph: fx.Graph, block: MoEBlock) -> fx.Node:
    """The model's integer input (token ids), which hash routing hashes."""
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
            return node
    raise PassError(
        f"locality_gate gate=hash routes {block.path} by token id, but the model takes no integer input; use gate=switch"
    )


def _copy_value(new: fx.Node, old: fx.Node | None, k: int) -> None:
    value = old.meta.get("example_value") if old is not None else None
    if isinstance(value, torch.Tensor):
        new.meta["example_value"] = value if value.shape[-1] == k else value[..., :k]


def _position(graph: fx.Graph, node: fx.Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)
