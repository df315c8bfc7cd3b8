"""Peer `dtensor_tp`: the model's attention and MLP blocks tensor-parallel with PyTorch's own
DTensor TP (`torch.distributed.tensor.parallel.parallelize_module`, `ColwiseParallel` /
`RowwiseParallel` over a 1-D DeviceMesh of the whole world): what a user picks instead of
commfx's `tensor_parallel` and `resize_tp` (ZERO-resizing's baseline). Exact: the same function
as the single-process model, checked in float64.

The plan is the one commfx's `tensor_parallel` pass infers, recorded torchtitan-style
(`program.regions.tp_plan.styles`: module path of each linear -> "colwise" or "rowwise") and
applied as `{path: ColwiseParallel() | RowwiseParallel()}` with DTensor's defaults: a colwise
linear takes its input replicated and hands on its local output shard (its input gradient is
all-reduced in backward), a rowwise linear takes the local shard and all-reduces its output.
Embeddings, norms, the LM head and any block the pass leaves replicated (experts included)
stay plain tensors on every rank. Tensor parallelism is the whole world and no data
parallelism: every rank runs the WHOLE batch (the bench hands it so with `--tp WORLD`).

What DTensor TP needs that a model may not give, and what the peer does:

- **Local head counts.** After a colwise q/k/v each rank holds its heads only, so the model's
  attention must shape them from the local tensor. torchtitan's models `view(bs, seqlen, -1,
  head_dim)` ("use -1 instead of n_heads ... as TP may have sharded them"), as HF's do;
  torchtitan's first TP plans (and PyTorch's TP example) instead divided the attention's
  `n_heads` / `n_kv_heads` by the TP size. The peer does the latter for the head-count
  attributes in :data:`HEAD_ATTRIBUTES` on each attention block the plan splits by heads, and
  refuses a count the world does not divide. A model that derives its head shape from the
  full width (`d // num_heads` with d the replicated input's width, a `reshape(b, s, d)`)
  fails on its local tensors: the check runs it first and refuses it by name.
- **Per-head parameters.** A module with parameters that runs on the heads inside a split
  attention (Qwen3's `q_norm`/`k_norm`, an RMSNorm of each head) sees only this rank's heads: as
  a plain tensor its weight would get only their share of the gradient (the check catches it,
  0.8 off on hf:qwen3). torchtitan's Qwen3 plan makes such a norm `SequenceParallel` on the heads
  dimension; the peer does the same (`sequence_dim=2` of [batch, seq, heads, head_dim]), so the
  weight is a replicated DTensor whose gradient DTensor sums over the ranks.
- **Fused q/k/v.** commfx splits a fused `qkv` by heads inside each of q, k and v (layout
  3 x heads x head_dim); `ColwiseParallel` shards the weight's rows contiguously, which gives
  rank 0 all of q. Refused by name.

Gradients and the optimizer: DTensor parameters (the split linears' weights and biases,
sharded) and plain ones (replicated, each rank computing the same whole-batch gradient),
stepped by torch's AdamW. The collectives DTensor issues in a step are seen by a dispatch mode
(`_c10d_functional` ops) and kept as :class:`CommRecord`\\ s; `compute_only` runs the same step
with each of them replaced by a local copy of its input (same size, no communication; the
partial sums are not summed, so its numbers are not the model's: for timing only).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .common import CommRecord, PeerCheck, PeerUnsupported, loss_and_backward, reference_step, relative_diff, score_forward, worst_over_ranks

NAME = "dtensor_tp"
WHOLE_BATCH = True  # every rank runs the whole batch: the tensor-parallel group is the world
TOLERANCE = 1e-10  # float64, the rowwise partial sums added in another order
TOLERANCE_REASON = "float64; DTensor's all-reduce adds the rowwise partial sums in its own order"
# Attributes an attention module may shape its heads by (torchtitan's first plans divided n_heads
# and n_kv_heads by the TP size; PyTorch's TP example does the same).
HEAD_ATTRIBUTES = ("num_heads", "n_heads", "heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads", "num_kv_heads")
# functional collectives DTensor issues -> the kind a CommRecord replays
_COLLECTIVES = {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


def infer_plan(model: nn.Module, inputs, world_size: int) -> tuple[dict[str, str], dict[str, int], list[str]]:
    """commfx's inferred TP plan for `model` at tp = world: (styles: module path -> "colwise" or
    "rowwise", head blocks: attention path -> its head count, notes). One process, no group
    needed; a model the plan cannot split for DTensor raises PeerUnsupported naming what."""
    from ...api import compile_program
    from ...passes import PassError
    from ...plan import Plan, PlanError

    plan = Plan.from_cli("lift,tensor_parallel", world_size=world_size, tp=world_size)
    try:
        program = compile_program(copy.deepcopy(model), plan, inputs)
    except (PassError, PlanError) as why:
        raise PeerUnsupported(f"commfx's tensor_parallel gives no plan to apply with DTensor: {why}") from None
    tp_plan, shards = program.regions.tp_plan, program.runtime.shards
    for block in tp_plan.blocks:
        for linear in block.colwise:
            layout = shards.get(f"{linear}.weight", {}).get("layout")
            if layout and layout[0] > 1:
                raise PeerUnsupported(
                    f"{linear}: a fused linear of {layout[0]} parts ({block.units} {block.unit} each), which commfx splits by "
                    f"{block.unit} inside every part; DTensor's ColwiseParallel shards its rows contiguously (rank 0 would "
                    "hold the first part whole): split it into one linear per part to compare with DTensor TP")
    heads = {b.path: b.units for b in tp_plan.blocks if b.unit == "heads"}
    notes = [f"plan (commfx tensor_parallel at tp={world_size}): " + "; ".join(tp_plan.lines())]
    notes += [f"left replicated: {s}" for s in program.regions.tp_skipped or []]
    return dict(tp_plan.styles), heads, notes


def localise_head_counts(module: nn.Module, heads: dict[str, int], world_size: int) -> list[str]:
    """Divide each split attention block's head-count attributes by the TP size (torchtitan's
    first plans, PyTorch's TP example); returns what changed. A count the world does not divide
    is refused."""
    changed = []
    for path in heads:
        block = module.get_submodule(path)
        for name in HEAD_ATTRIBUTES:
            value = getattr(block, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value % world_size:
                raise PeerUnsupported(f"{path}.{name}={value}: the tensor-parallel size {world_size} does not divide it")
            setattr(block, name, value // world_size)
            changed.append(f"{path}.{name} {value} -> {value // world_size}")
    return changed


def parallelize(module: nn.Module, styles: dict[str, str], mesh) -> None:
    """`parallelize_module` with the plan: ColwiseParallel / RowwiseParallel, DTensor's defaults."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = {path: style for path, style in styles.items() if style not in kinds}
    if unknown:
        raise PeerUnsupported(f"styles other than colwise and rowwise: {unknown}")
    parallelize_module(module, mesh, {path: kinds[style]() for path, style in styles.items()})


def per_head_modules(module: nn.Module, heads: dict[str, int], styles: dict[str, str]) -> list[str]:
    """Modules with parameters inside a split attention block other than its split linears: a
    norm of each head (Qwen3's q_norm, k_norm), which runs on this rank's heads only. As a plain
    tensor its weight would get this rank's heads' share of the gradient; torchtitan's Qwen3 plan
    makes it `SequenceParallel(sequence_dim=2)` (the weight a replicated DTensor, its input
    sharded on the heads dimension of [batch, seq, heads, head_dim]), so DTensor sums the
    ranks' shares. The check proves the result."""
    found = []
    for path in heads:
        for name, child in module.get_submodule(path).named_modules():
            full = f"{path}.{name}" if name else path
            if not name or full in styles or any(s.startswith(full + ".") for s in styles):
                continue
            if any(True for _ in child.parameters(recurse=False)):
                found.append(full)
    return found


class _Collectives(TorchDispatchMode):
    """Records each functional collective DTensor issues (kind, payload bytes); with `local`,
    replaces it by a copy of its input (the compute-only step)."""

    def __init__(self, local: bool = False):
        super().__init__()
        self.local, self.records = local, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, rest = func.name().partition("::")
        if namespace == "_c10d_functional" and rest.split(".")[0] not in ("wait_tensor", "_wrap_tensor_autograd"):
            op = rest.split(".")[0]
            if op not in _COLLECTIVES:
                raise RuntimeError(f"peer:dtensor_tp issued {func.name()}, which its byte count and replay do not cover")
            tensor = args[0]
            self.records.append(CommRecord(_COLLECTIVES[op], dist.get_world_size(), tensor.numel() * tensor.element_size()))
            if self.local:
                return tensor.clone()
        return func(*args, **kwargs)


def _same_batch_everywhere(inputs) -> None:
    """Every rank must hold the same whole batch (collective): tensor parallelism over the world
    has no data parallelism. Compares shapes and two checksums of every input tensor."""
    from ...verify import batch_tensors

    figures = []
    for t in batch_tensors(inputs):
        flat = t.detach().double().flatten()
        figures += [float(t.numel()), flat.sum().item(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum().item()]
    mine = torch.tensor(figures, dtype=torch.float64)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise PeerUnsupported(
            f"peer:{NAME} runs the whole batch on every rank (the tensor-parallel group is the world, no data parallelism), "
            f"but the ranks were handed different batches: run the bench with --tp {dist.get_world_size()}")


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 0.0, inputs=None) -> None:
    """What can be refused in one process before any rank starts: a head count the world does not
    divide; given the batch (`inputs`), also a model the inferred plan cannot split for DTensor (a
    fused q/k/v, no block). Without it, those are refused by `check` on every rank, before timing."""
    from ...passes.tensor_parallel import _head_counts

    for where, name, value in _head_counts(model):
        if value % world_size:
            raise PeerUnsupported(f"{where}.{name}={value}: tensor parallelism over the {world_size} ranks does not divide it")
    if inputs is not None:
        infer_plan(model, inputs, world_size)


class DTensorTPPeer:
    """The model with commfx's inferred TP plan applied by DTensor on a 1-D CPU mesh of the
    world, stepped by torch's AdamW; `inputs` is the whole batch, the same on every rank
    (collective: checked at construction). `styles` overrides the inferred plan."""

    name = NAME
    tolerance = TOLERANCE

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 0.0,
                 styles: dict[str, str] | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        from ...models.hf import choose_experts_implementation

        world = dist.get_world_size()
        _same_batch_everywhere(inputs)
        self.inputs = inputs
        inferred, heads, self.notes = infer_plan(model, inputs, world)
        self.styles = dict(styles) if styles is not None else inferred
        self.module = copy.deepcopy(model)
        choose_experts_implementation(self.module)
        self.notes += localise_head_counts(self.module, {p: n for p, n in heads.items() if self._splits(p)}, world)
        self.mesh = init_device_mesh("cpu", (world,))
        parallelize(self.module, self.styles, self.mesh)
        self.per_head = per_head_modules(self.module, {p: n for p, n in heads.items() if self._splits(p)}, self.styles)
        if self.per_head:
            from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

            parallelize_module(self.module, self.mesh, {path: SequenceParallel(sequence_dim=2, use_local_output=True) for path in self.per_head})
            self.notes.append(f"per-head modules, SequenceParallel on the heads dimension: {', '.join(self.per_head)}")
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self._records: list[CommRecord] = []

    def _splits(self, block_path: str) -> bool:
        return any(path.startswith(block_path + ".") for path in self.styles)

    def forward_backward(self) -> torch.Tensor:
        return loss_and_backward(self.module, self.module, self.inputs)

    def train_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with _Collectives() as seen:
            loss = self.forward_backward()
        self._records = seen.records
        self.optimizer.step()
        return loss

    def compute_only(self) -> torch.Tensor:
        """The same step with each of DTensor's all-reduces replaced by a local copy of its input
        (same shapes and compute, no communication; the parameters move, as DDP's no_sync step
        moves them)."""
        self.optimizer.zero_grad(set_to_none=True)
        with _Collectives(local=True):
            loss = self.forward_backward()
        self.optimizer.step()
        return loss

    def step_bytes(self) -> dict[str, int]:
        """Payload bytes the last training step handed DTensor's collectives, per kind (this rank)."""
        out: dict[str, int] = {}
        for record in self._records:
            out[record.kind] = out.get(record.kind, 0) + record.nbytes
        return out

    @property
    def records(self) -> list[CommRecord]:
        """The last training step's collectives: one all-reduce of each rowwise linear's output in
        forward, one of each colwise linear's input gradient in backward (DTensor does not merge
        the q, k and v inputs' as commfx's tp_copy does)."""
        return list(self._records)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t  # collective for a DTensor


def check(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, dtype: torch.dtype | None = torch.float64,
          styles: dict[str, str] | None = None, **_) -> PeerCheck:
    """DTensor TP on the whole of `global_inputs` against the single-process model on the same
    batch, in `dtype`: outputs, loss, every gradient (gathered whole), the AdamW step (collective).
    A plan the model's code cannot run on its local shards is refused (PeerUnsupported) by name.
    `styles` overrides the inferred plan (a test's wrong split)."""
    from torch.utils import _pytree as pytree

    from ...models.hf import choose_experts_implementation, training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call, local_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = copy.deepcopy(model).to(dtype) if dtype is not None else copy.deepcopy(model)
    choose_experts_implementation(reference)
    peer = DTensorTPPeer(reference, global_inputs, ep_size=ep_size, lr=lr, styles=styles)
    ref = reference_step(reference, global_inputs, lr)

    try:
        with training_forward(peer.module):
            out = call(peer.module, global_inputs)
        loss = loss_fn(out, batch_tensors(global_inputs))
        loss.backward()
    except RuntimeError as why:  # the same code on the same shapes: every rank fails alike
        plan = ", ".join(f"{p} {s}" for p, s in peer.styles.items())
        raise PeerUnsupported(f"the model does not run on its local shards under DTensor TP ({plan}): "
                              f"{str(why).splitlines()[0]}") from None
    check_ = PeerCheck(NAME, TOLERANCE, TOLERANCE_REASON, step_tolerance=TOLERANCE)
    outputs = [t for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    # every rank holds the whole batch's outputs: its rows go through score_forward, all of them here
    score_forward(check_, local_batch(tuple(outputs), world, rank), loss, ref)
    whole = max((relative_diff(a, b) for a, b in zip(outputs, ref.outputs, strict=True)), default=float("nan"))
    check_.output_diff = max(check_.output_diff, whole)

    named = dict(peer.module.named_parameters())
    grads = {n: _full(p.grad) for n, p in named.items()}  # every rank gathers in the same order
    check_.grad_diffs = {n: relative_diff(g, ref.grads[n]) for n, g in grads.items()}
    # the step torch's AdamW takes from the peer's gradients, on the model's initial parameters
    stepped = {n: nn.Parameter(ref.initial[n].clone()) for n in named}
    for n, p in stepped.items():
        p.grad = grads[n].clone()
    torch.optim.AdamW(stepped.values(), lr=lr).step()
    peer.optimizer.step()
    after = {n: _full(p.detach()) for n, p in named.items()}
    check_.step_diffs = {n: relative_diff(after[n], stepped[n]) for n in named}
    check_.model_step_diffs = {n: relative_diff(after[n], ref.stepped[n]) for n in named}
    worst_over_ranks(check_)
    distributed = sum(1 for p in named.values() if hasattr(p, "placements"))
    check_.notes += peer.notes + [f"{distributed} of {len(named)} parameters DTensors (sharded or replicated) on a 1-D mesh of {world} ranks; "
                                  "every rank runs the whole batch"]
    return check_


Runner = DTensorTPPeer  # the names every peer module gives the bench
