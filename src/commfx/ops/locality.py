"""LocMoE's routing ops: node-limited top-k, the GrAP gate, the auxiliary losses and the
identity op that adds their gradient to training.

Routing that prefers the token's own node is lossy (it changes which experts run), so it
comes with losses that keep it balanced: the load-balancing loss alpha * E * sum_i f_i P_i
(Switch/GShard) and LocMoE's locality loss mu * KL(p || q), p the batch's routing mass per
node and q the fully node-local distribution. `add_aux_loss` returns its input unchanged and
sends d(loss) into backward, so the model's outputs stay what they are and no training loop
has to know the loss exists. The latest values are kept in `LAST_AUX_LOSSES` for reports.
"""

from __future__ import annotations

import math

import torch

from ..runtime.comm import current_scheduler

# op tag -> (balance loss, locality loss) of the latest forward, for per-step reports
LAST_AUX_LOSSES: dict[str, tuple[float, float]] = {}
# op tag -> the latest batch's capacity: delta, floor, configured and used factors, rows per expert
LAST_CAPACITY: dict[str, dict[str, float]] = {}
# KL against a one-hot q is infinite off the home node: q keeps this much mass elsewhere
LOCALITY_SMOOTHING = 0.01


# ---------------------------------------------------------------------------- gates


def grap_scores(x: torch.Tensor, num_experts: int) -> torch.Tensor:
    """GrAP (grouped average pooling, LocMoE): [T, d] -> [T, E] = relu(mean of d/E-wide groups).

    The gate is fixed and orthogonal: expert e's gate vector averages hidden units
    [e*d/E, (e+1)*d/E). Softmax and top-k come after, as for any router."""
    d = x.shape[-1]
    if d % num_experts:
        raise ValueError(
            f"the GrAP gate splits the hidden size {d} into {num_experts} equal groups (one per expert), "
            f"but {d} is not divisible by {num_experts}; use gate=model, or a model whose hidden size is a multiple of the expert count"
        )
    return torch.relu(x.reshape(x.shape[0], num_experts, d // num_experts).mean(-1))


def grap_gate_vectors(d: int, num_experts: int, dtype=torch.float64) -> torch.Tensor:
    """[E, d]: the GrAP gate as weight rows (scores = x @ W.T before the ReLU)."""
    width = d // num_experts
    return torch.kron(torch.eye(num_experts, dtype=dtype), torch.full((1, width), 1.0 / width, dtype=dtype))


# ---------------------------------------------------------------------------- routing


def node_limited_topk(
    scores: torch.Tensor,
    k: int,
    expert_node: list[int],
    home: torch.Tensor,
    max_nodes: int,
    max_remote_fraction: float,
    balance: float = 0.0,
) -> torch.Tensor:
    """Top-k experts per token on at most `max_nodes` nodes, with at most a fraction of the
    tokens leaving the home node.

    Nodes are ranked per token by the sum of their best ceil(k / max_nodes) scores
    (DeepSeek-V3's node-limited routing); top-k then picks among the chosen nodes' experts.
    FasterGate's cap: only the floor(fraction * T) tokens that gain most (summed top-k scores
    over the home-only choice) may route off the home node; the rest choose among home experts.
    `home` is a bool [E]: the experts on this rank's node. With `balance` > 0 no expert takes
    more than `balance` x the mean rows of its node's experts (see `balanced_topk`).
    Returns int64 indices [T, k].
    """
    tokens, experts = scores.shape
    nodes = torch.tensor(expert_node, device=scores.device)
    num_nodes = max(expert_node) + 1 if expert_node else 1
    on_node = nodes.unsqueeze(0) == torch.arange(num_nodes, device=scores.device).unsqueeze(1)  # [N, E]
    per_node = min(math.ceil(k / max_nodes), int(on_node.sum(1).min()))
    masked = scores.unsqueeze(1).masked_fill(~on_node.unsqueeze(0), float("-inf"))  # [T, N, E]
    node_score = masked.topk(per_node, dim=-1).values.sum(-1)  # [T, N]
    chosen_nodes = node_score.topk(min(max_nodes, num_nodes), dim=-1).indices  # [T, M]
    allowed = on_node[chosen_nodes].any(1)  # [T, E]
    if max_remote_fraction < 1.0:
        free = scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).values.sum(-1)
        local = scores.masked_fill(~home.unsqueeze(0), float("-inf")).topk(k, dim=-1).values.sum(-1)
        gain = free - local
        may_leave = torch.zeros(tokens, dtype=torch.bool, device=scores.device)
        budget = int(max_remote_fraction * tokens)
        if budget:
            leaving = gain.topk(min(budget, tokens)).indices
            may_leave[leaving[gain[leaving] > 0]] = True
        allowed = torch.where(may_leave.unsqueeze(1), allowed, home.unsqueeze(0).expand_as(allowed))
    if balance > 0:
        return balanced_topk(scores, allowed, k, nodes, on_node, balance)
    return scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices


def balanced_topk(
    scores: torch.Tensor, allowed: torch.Tensor, k: int, nodes: torch.Tensor, on_node: torch.Tensor, balance: float
) -> torch.Tensor:
    """Top-k among `allowed` [T, E], where no expert takes more than ceil(balance x the mean
    rows of its node's experts): an over-full expert keeps its best-scoring tokens, and the
    others fall back to their next allowed choice (BASE layers' balanced assignment, greedy).

    Only `allowed` shrinks, so node limits and the off-node cap still hold; a token never
    loses a choice it needs to keep k allowed experts. Per rank, so when both nodes receive
    the same rows over the ranks, every expert's load over the ranks is <= balance x mean
    (+ one row per rank from the ceiling)."""
    tokens, experts = scores.shape
    experts_per_node = on_node.sum(1).to(scores.dtype)
    for _ in range(4 * experts):  # each round takes away >= 1 (token, expert) pair; bounded
        indices = scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
        picked = torch.zeros_like(allowed).scatter_(1, indices, True)
        counts = picked.sum(0)
        node_rows = torch.zeros(on_node.shape[0], dtype=scores.dtype, device=scores.device).index_add_(0, nodes, counts.to(scores.dtype))
        cap = torch.ceil(balance * node_rows / experts_per_node)[nodes]
        over = counts > cap
        if not bool(over.any()):
            return indices
        # position of each picked token in its expert's queue, best score first
        queue = scores.masked_fill(~picked, float("-inf")).argsort(0, descending=True).argsort(0)
        drop = picked & over.unsqueeze(0) & (queue >= cap.unsqueeze(0))
        drop &= ((allowed & ~drop).sum(1) >= k).unsqueeze(1)
        if not bool(drop.any()):
            return indices
        allowed = allowed & ~drop
    return scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices


@torch.library.custom_op("commfx::home_experts", mutates_args=())
def home_experts(like: torch.Tensor, expert_node: list[int], rank_node: list[int], group: str) -> torch.Tensor:
    """bool [E]: experts on this rank's node. The rank is a runtime value (the graph is the
    same on every rank); `rank_node[i]` is the node of index i of `group`."""
    home = rank_node[current_scheduler().group(group).rank]
    return torch.tensor([n == home for n in expert_node], dtype=torch.bool, device=like.device)


@home_experts.register_fake
def _(like, expert_node, rank_node, group):
    return like.new_empty((len(expert_node),), dtype=torch.bool)


@torch.library.custom_op("commfx::locality_topk", mutates_args=())
def locality_topk(
    scores: torch.Tensor,
    home: torch.Tensor,
    k: int,
    expert_node: list[int],
    max_nodes: int,
    max_remote_fraction: float,
    balance: float = 0.0,
) -> torch.Tensor:
    """`node_limited_topk` as a graph op (indices only: weights are gathered differentiably)."""
    return node_limited_topk(scores, k, expert_node, home, max_nodes, max_remote_fraction, balance)


@locality_topk.register_fake
def _(scores, home, k, expert_node, max_nodes, max_remote_fraction, balance=0.0):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)


def hash_experts(token_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Hash routing (Roller et al.): a fixed multiplicative hash of the token id picks one expert."""
    return ((token_ids.reshape(-1, 1).to(torch.int64) * 2654435761) % (1 << 32)) % num_experts


def hash_route(token_ids: torch.Tensor, x: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, 1] expert of each token by the hash of its id; `x` is any [T, ...] tensor of the MoE rows
    (its router probabilities), which the ids must match row for row."""
    torch._check(
        token_ids.numel() == x.shape[0],
        lambda: f"gate=hash routes by token id, but the model's ids hold {token_ids.numel()} tokens and the MoE input "
        f"{x.shape[0]} rows; use gate=switch for a model whose MoE rows are not its input tokens",
    )
    return hash_experts(token_ids, num_experts)


# ---------------------------------------------------------------------------- losses


def balance_loss(probs: torch.Tensor, indices: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * E * sum_i f_i P_i: f_i the fraction of assignments to expert i (no gradient),
    P_i the mean routing probability of expert i."""
    experts = probs.shape[-1]
    counts = torch.zeros(experts, dtype=probs.dtype, device=probs.device).index_add_(
        0, indices.reshape(-1), torch.ones(indices.numel(), dtype=probs.dtype, device=probs.device)
    )
    fraction = counts / counts.sum().clamp_min(1)
    return alpha * experts * (fraction * probs.mean(0)).sum()


def locality_loss(probs: torch.Tensor, home: torch.Tensor, expert_node: list[int], mu: float) -> torch.Tensor:
    """mu * KL(p || q): p the batch's mean routing mass per node, q node-local (home node
    1 - s, the others s / (N-1), s = LOCALITY_SMOOTHING so the KL stays finite)."""
    nodes = torch.tensor(expert_node, device=probs.device)
    num_nodes = max(expert_node) + 1  # from the list: a tensor's max would be data-dependent when traced
    if num_nodes == 1:
        return probs.new_zeros(())
    on_node = (nodes.unsqueeze(0) == torch.arange(num_nodes, device=probs.device).unsqueeze(1)).to(probs.dtype)  # [N, E]
    p = probs.mean(0) @ on_node.t()  # [N]
    home_node = (on_node @ home.to(probs.dtype) > 0).to(probs.dtype)
    s = LOCALITY_SMOOTHING
    q = home_node * (1 - s) + (1 - home_node) * (s / (num_nodes - 1))
    return mu * (p * (p.clamp_min(1e-30).log() - q.log())).sum()


def aux_losses(probs, indices, home, expert_node: list[int], alpha: float, mu: float) -> torch.Tensor:
    """[balance loss, locality loss] of one router (traced into the graph as plain ops)."""
    return torch.stack([balance_loss(probs, indices, alpha), locality_loss(probs, home, expert_node, mu)])


@torch.library.custom_op("commfx::add_aux_loss", mutates_args=())
def add_aux_loss(x: torch.Tensor, losses: torch.Tensor, tag: str) -> torch.Tensor:
    """Identity on x; backward adds d(sum(losses))/d(parameters) to training. Records the losses."""
    LAST_AUX_LOSSES[tag] = tuple(float(v) for v in losses.detach().reshape(-1).tolist())
    return x.clone()


@add_aux_loss.register_fake
def _(x, losses, tag):
    return torch.empty_like(x)


def _add_aux_loss_setup(ctx, inputs, output):
    ctx.loss_shape, ctx.loss_dtype = inputs[1].shape, inputs[1].dtype


def _add_aux_loss_backward(ctx, grad):
    # d(total)/d(losses) = 1: the losses count as if added to the model's loss.
    return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device), None


add_aux_loss.register_autograd(_add_aux_loss_backward, setup_context=_add_aux_loss_setup)


# ---------------------------------------------------------------------------- capacity floor


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by Lentz's continued fraction (Numerical Recipes' betacf), no scipy."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
        return 1.0 - regularized_incomplete_beta(1.0 - x, b, a)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h / a


def capacity_floor(delta: float, hidden: int, num_experts: int) -> float:
    """LocMoE's minimum expert capacity, as a fraction of the tokens: 1 / (n (1 - I_{δ²}(½, (d-1)/2))).

    1 - I_{δ²}(½, (d-1)/2) is the chance that a random direction in d dimensions has
    cos² >= δ² with a fixed gate vector; an expert whose tokens sit at cosine δ from its gate
    vector needs at least 1/n of the tokens divided by that chance."""
    tail = 1.0 - regularized_incomplete_beta(delta * delta, 0.5, (hidden - 1) / 2.0)
    return math.inf if tail <= 0 else 1.0 / (num_experts * tail)


def capacity_floor_large_d(delta: float, hidden: int, num_experts: int) -> float:
    """The bound's large-d form: (1/n) exp(δ² d / (2 - δ²))."""
    return math.exp(delta * delta * hidden / (2.0 - delta * delta)) / num_experts


def gate_cosine(x: torch.Tensor, gate_vectors: torch.Tensor, indices: torch.Tensor) -> float:
    """δ of a batch: the mean |cos| between each token and the gate vector of each expert it goes to."""
    token = torch.nn.functional.normalize(x.detach().to(torch.float64), dim=-1)
    gate = torch.nn.functional.normalize(gate_vectors.detach().to(torch.float64), dim=-1)
    cos = (token.unsqueeze(1) * gate[indices]).sum(-1)
    return float(cos.abs().mean()) if cos.numel() else 0.0


def capacity_floor_factor(delta: float, hidden: int, num_experts: int, k: int) -> float:
    """The floor as a capacity factor (1 = the even share T k / E): n * floor, at most E / k
    (where every expert may take every token, so nothing is ever dropped)."""
    return min(num_experts * capacity_floor(delta, hidden, num_experts), num_experts / k)


@torch.library.custom_op("commfx::measure_capacity_floor", mutates_args=())
def measure_capacity_floor(
    x: torch.Tensor, gate_vectors: torch.Tensor | None, indices: torch.Tensor, num_experts: int, configured: float, tag: str
) -> torch.Tensor:
    """float64 scalar: LocMoE's capacity floor as a factor, from δ measured on this batch.

    `gate_vectors` [E, d] are the router's weight rows (None: the GrAP gate's). Records δ, the
    floor, the configured factor and max(floor, configured) in LAST_CAPACITY[tag]."""
    from .moe import expert_capacity

    hidden, k = x.shape[-1], indices.shape[-1]
    gate = grap_gate_vectors(hidden, num_experts) if gate_vectors is None else gate_vectors
    delta = gate_cosine(x, gate, indices)
    floor = capacity_floor_factor(delta, hidden, num_experts, k)
    used = max(configured, floor)
    LAST_CAPACITY[tag] = {
        "delta": delta,
        "floor": floor,
        "configured": configured,
        "used": used,
        "rows_per_expert": expert_capacity(x.shape[0], k, num_experts, used),
    }
    return torch.tensor(floor, dtype=torch.float64)


@measure_capacity_floor.register_fake
def _(x, gate_vectors, indices, num_experts, configured, tag):
    return x.new_empty((), dtype=torch.float64)


def aux_loss_report() -> str:
    """One line per MoE layer of the latest forward's auxiliary losses (empty without locality_gate)."""
    return "\n".join(
        f"  aux losses {tag}: balance {balance:.4f}  locality {locality:.4f}"
        for tag, (balance, locality) in sorted(LAST_AUX_LOSSES.items())
    )


def capacity_report() -> str:
    """One line per MoE layer of the latest batch's capacity (empty when no floor is measured)."""
    return "\n".join(
        f"  capacity {tag}: delta {c['delta']:.3f}  LocMoE floor {c['floor']:.3f}  configured {c['configured']:g}  "
        f"-> factor {c['used']:.3f} ({c['rows_per_expert']} rows per expert)"
        for tag, c in sorted(LAST_CAPACITY.items())
    )
