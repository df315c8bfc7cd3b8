"""Peer `deepspeed_moe`: the model's MoE blocks rebuilt as DeepSpeed-MoE layers (Lina's baseline).

:func:`build_deepspeed_moe` copies a model and replaces each MoE block it recognises by a
`deepspeed.moe.layer.MoE` with the same router weight (the gate's `wg`), the same k, the same
capacity rule and expert-parallel size, and this rank's experts (a SiLU-gated MLP each, holding
its slice of the stacked `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`). Everything else
is copied unchanged. :class:`DeepSpeedMoEPeer` trains it through DeepSpeed's engine, and
:func:`check_deepspeed_moe` proves it computes the single-process model's function.

Where DeepSpeed's gate (`deepspeed/moe/sharded_moe.py`, 0.19.8) differs from the models' router
and what the peer does about it (the top-k weights, routing bias and which blocks it reads:
:mod:`.moe_blocks`):

- **float32 gate.** `TopKGate.forward` computes the logits as `linear(x.float(), wg.float())`, so
  the softmax, the top-k choice and the combine weights are float32 whatever the model's dtype
  (the expert inputs and outputs keep the model's dtype; the weighted sum is taken in the
  model's dtype). This cannot be turned off: in a float64 run the peer equals the model at
  :data:`PEER_TOLERANCE`, not at commfx's 1e-10. (HF Mixtral and Qwen3-MoE take their own
  router softmax in float32 too; gpt-moe takes it in the model's dtype.)
- **Random choices, all off:** `noisy_gate_policy=None` (no jitter, no Gumbel sampling of the
  top-1 expert), `top2_2nd_expert_sampling=False` (DeepSpeed adds Gumbel noise to the logits
  before choosing the second expert by default), `use_rts=False` (random token selection
  when dropping), `use_residual=False`, no Tutel.
- **Capacity.** `drop_tokens=False` (the default, and the issue's first look) is dropless:
  each layer's capacity is the largest expert load over the expert-parallel group (one
  all-reduce of a scalar per layer) and every all-to-all is padded to it: the function is the
  model's, the traffic is `E x capacity` rows per rank. `drop_tokens=True` uses DeepSpeed's
  capacity `ceil(capacity_factor x k x tokens / E)` per rank (commfx's formula;
  `min_capacity` is set to 0 so DeepSpeed's floor of 4 does not raise it), but DeepSpeed
  drops another way than commfx's capacity mode: k = 2 keeps every first choice before any
  second choice, k >= 3 keeps the highest-probability assignments, and the kept weights of a
  token are renormalised. So a `drop_tokens=True` peer computes the model's function only
  while nothing is dropped; :func:`check_deepspeed_moe` counts dropped assignments and says so.
- **l_aux.** DeepSpeed's load-balancing loss is computed and kept on each rebuilt block
  (`block.l_aux`), never added to the loss: the models here train without one (a HF model
  with `output_router_logits=True`, which adds its own, is refused).

Gradients and the optimizer: the engine (`deepspeed.initialize`, ZeRO stage 0, no fp16/bf16,
no gradient clipping) all-reduces the gradients at the end of `engine.backward`: non-expert
gradients averaged over the data-parallel group, expert gradients summed over the
expert-data-parallel group and divided by the data-parallel size (DeepSpeed's rule, which gives
the global-batch gradient when every rank holds the same number of tokens). The optimizer is
torch's AdamW (a client optimizer, over DeepSpeed's MoE parameter groups), stepped by
`engine.step()`. The engine runs on the CPU accelerator over gloo.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .moe_blocks import NAME, MoESpec, find_moe_blocks  # noqa: F401  (find_moe_blocks: re-exported)
from .common import CommRecord, PeerCheck, PeerUnsupported, reference_step, relative_diff, score_forward, worst_over_ranks


# DeepSpeed's gate computes in float32 (see the module docstring): in a float64 run the peer's
# outputs, loss, gradients and parameters after a step carry float32 rounding of the routing
# weights and of the router's gradient. Judged relative to each tensor's largest entry, at 64 x
# float32's epsilon (7.6e-6), the margin commfx's verify gives a part a model computes in float32.
PEER_TOLERANCE = 64 * torch.finfo(torch.float32).eps
# The optimizer step itself is DeepSpeed's engine stepping torch's AdamW: from the same gradients it
# gives the same parameters as torch's AdamW, exactly (commfx's float64 tolerance).
STEP_TOLERANCE = 1e-10
PEER_TOLERANCE_REASON = ("DeepSpeed's TopKGate computes logits, softmax and routing weights in float32 "
                         "(linear(x.float(), wg.float())): 64 x eps(float32), relative to each tensor's largest entry")


def deepspeed_version() -> str | None:
    """The installed DeepSpeed's version, or None when it cannot be imported."""
    try:
        return _deepspeed().__version__
    except ImportError:
        return None


def _deepspeed():
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"  # skip DeepSpeed's accelerator probing (and its warning)
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(f"peer:{NAME} needs DeepSpeed: pip install 'commfx[peers]' (deepspeed==0.19.8)") from error
    import logging

    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


# --- the rebuilt block -------------------------------------------------------------------------------------------


class GatedExpert(nn.Module):
    """One expert: act(x W_gate^T) * (x W_up^T), then W_down: the model's expert FFN for one expert."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone())  # [2I, H]
        self.down_proj = nn.Parameter(down.detach().clone())  # [H, I]
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


class DeepSpeedMoEBlock(nn.Module):
    """A model's MoE block as a DeepSpeed `MoE` layer: hidden states in, hidden states out.

    `moe` holds DeepSpeed's gate (`moe.deepspeed_moe.gate.wg`, the router's weight) and this
    rank's experts (`moe.deepspeed_moe.experts.deepspeed_experts[j]` is global expert
    `expert_ids[j]`). DeepSpeed's load-balancing loss of the last forward is kept in `l_aux`
    and is not part of the output; `dropped` and `capacity` say what the last forward's gate
    decided."""

    def __init__(self, spec: MoESpec, moe: nn.Module, expert_ids: list[int]):
        super().__init__()
        self.spec = spec
        self.moe = moe
        self.expert_ids = expert_ids
        self.l_aux: torch.Tensor | None = None
        self.dropped = 0
        self.capacity = 0
        moe.deepspeed_moe.gate.register_forward_hook(self._record_gate)

    def _record_gate(self, gate, args, output) -> None:
        # MOELayer asks for sparse routes: (l_aux, capacity, E, indices [k, S], locations, gates, counts);
        # an assignment dropped for capacity has index -1.
        self.capacity = int(output[1])
        self.dropped = int((output[3] < 0).sum())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, self.l_aux, _ = self.moe(hidden_states)
        return output


def _ensure_comm() -> None:
    """DeepSpeed's comm layer on the existing default process group (gloo here)."""
    deepspeed = _deepspeed()
    if not dist.is_initialized():
        raise RuntimeError(f"peer:{NAME} needs torch.distributed initialised on every rank first "
                           "(commfx.runtime.launcher.launch does it)")
    # DeepSpeed's engine reads these from the environment (torchrun sets them; commfx's launcher
    # sets MASTER_ADDR/PORT and WORLD_SIZE). LOCAL_RANK only picks an accelerator device: none on the CPU.
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (C++, on first use) that only
    # its inference path calls; marked unavailable, nothing is compiled and no shared memory set up.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # With the default group already up, init_distributed wraps it (TorchBackend) and starts nothing.
    deepspeed.init_distributed(dist_backend=dist.get_backend())


def _expert_groups(ep_size: int):
    """DeepSpeed's expert-parallel group of this rank (created once, collectively, on every rank)."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


def preflight(model: nn.Module, *, ep_size: int, world_size: int, capacity_factor: float = 1.0,
              drop_tokens: bool = False, inputs=None) -> list[MoESpec]:
    """What every rank would refuse, found in one process before any rank starts (no process
    group needed): the model's MoE blocks as the peer reads them, or PeerUnsupported; an
    ImportError when DeepSpeed is not installed."""
    _deepspeed()
    specs = find_moe_blocks(model)
    if ep_size < 1 or world_size % ep_size:
        raise PeerUnsupported(f"ep_size={ep_size} must divide the world size {world_size}")
    for spec in specs:
        if spec.num_experts % ep_size:
            raise PeerUnsupported(f"{spec.path}: {spec.num_experts} experts do not divide over ep_size={ep_size}")
    if drop_tokens and not capacity_factor > 0:
        raise PeerUnsupported(f"drop_tokens=True needs capacity_factor > 0 (got {capacity_factor})")
    return specs


def _rebuild(model: nn.Module, *, ep_size: int, capacity_factor: float, drop_tokens: bool, attach_groups: bool) -> nn.Module:
    from deepspeed.moe.layer import MoE

    world = dist.get_world_size() if dist.is_initialized() else 1
    specs = preflight(model, ep_size=ep_size, world_size=world, capacity_factor=capacity_factor, drop_tokens=drop_tokens)
    _ensure_comm()
    ep_rank = dist.get_rank(group=_expert_groups(ep_size)) if ep_size > 1 else 0

    params = dict(model.named_parameters())
    # Copy everything but the MoE blocks (which are rebuilt, so their full expert stacks are not copied).
    memo = {id(model.get_submodule(s.path)): None for s in specs}
    peer = copy.deepcopy(model, memo)
    for spec in specs:
        local = spec.num_experts // ep_size
        ids = list(range(ep_rank * local, (ep_rank + 1) * local))
        gate_up, down = params[spec.gate_up], params[spec.down]
        moe = MoE(gate_up.shape[-1], GatedExpert(gate_up[ids[0]], down[ids[0]], spec.act), num_experts=spec.num_experts,
                  ep_size=ep_size, k=spec.top_k, capacity_factor=capacity_factor if drop_tokens else 1.0,
                  eval_capacity_factor=capacity_factor if drop_tokens else 1.0, min_capacity=0, use_residual=False,
                  noisy_gate_policy=None, drop_tokens=drop_tokens, use_rts=False, use_tutel=False,
                  top2_2nd_expert_sampling=False)
        router = params[spec.router_weight]
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight = nn.Parameter(router.detach().clone())
            for expert, e in zip(moe.deepspeed_moe.experts.deepspeed_experts, ids):
                expert.gate_up_proj.copy_(gate_up[e].to(expert.gate_up_proj.dtype))
                expert.down_proj.copy_(down[e].to(expert.down_proj.dtype))
        if attach_groups and ep_size > 1:
            moe.set_deepspeed_parallelism()
        parent_path, _, attribute = spec.path.rpartition(".")
        parent = peer.get_submodule(parent_path) if parent_path else peer
        setattr(parent, attribute, DeepSpeedMoEBlock(spec, moe, ids))
    return peer


def build_deepspeed_moe(model: nn.Module, *, ep_size: int, capacity_factor: float = 1.0, drop_tokens: bool = False) -> nn.Module:
    """A copy of `model` whose MoE blocks are DeepSpeed-MoE layers (call on every rank; collective).

    Needs torch.distributed initialised (gloo on CPUs); DeepSpeed's comm layer wraps the default
    group and its expert-parallel groups are created once. The MoE layers' expert groups are
    attached, so the module runs forward and backward as returned (gradients are not
    synchronised: :class:`DeepSpeedMoEPeer` trains it through DeepSpeed's engine, which does).
    `capacity_factor` matters only with `drop_tokens=True` (see the module docstring).
    Raises :class:`PeerUnsupported` for what DeepSpeed's MoE cannot express."""
    return _rebuild(model, ep_size=ep_size, capacity_factor=capacity_factor, drop_tokens=drop_tokens, attach_groups=True)


def moe_blocks(peer: nn.Module) -> list[DeepSpeedMoEBlock]:
    return [m for m in peer.modules() if isinstance(m, DeepSpeedMoEBlock)]


def parameter_sources(peer: nn.Module) -> dict[str, tuple[str, int | None]]:
    """Peer parameter name -> (the model's parameter name, expert index or None): what each of
    this rank's parameters holds of the single-process model."""
    sources: dict[str, tuple[str, int | None]] = {}
    blocks = {name: block for name, block in peer.named_modules() if isinstance(block, DeepSpeedMoEBlock)}
    for name, _ in peer.named_parameters():
        owner = next((b for b in blocks if name.startswith(b + ".")), None)
        if owner is None:
            sources[name] = (name, None)
            continue
        block, rest = blocks[owner], name[len(owner) + 1:]
        if rest == "moe.deepspeed_moe.gate.wg.weight":
            sources[name] = (block.spec.router_weight, None)
            continue
        prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
        local, _, leaf = rest.removeprefix(prefix).partition(".")
        stacked = {"gate_up_proj": block.spec.gate_up, "down_proj": block.spec.down}[leaf]
        sources[name] = (stacked, block.expert_ids[int(local)])
    return sources


# --- training ----------------------------------------------------------------------------------------------------


_COUNTED = ("all_to_all_single", "all_reduce")
_FORBIDDEN_LOCAL = ("broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
                    "send", "recv", "isend", "irecv", "reduce", "gather", "scatter")




@contextlib.contextmanager
def _deepspeed_comm(records: list[CommRecord], local: bool):
    """Record every all-to-all and all-reduce DeepSpeed issues (its MoE layers and its engine call
    them through `deepspeed.comm`); with `local`, each becomes a local copy of the same size and
    any other collective is an error."""
    import deepspeed.comm as ds_comm

    originals = {name: getattr(ds_comm, name) for name in (*_COUNTED, *_FORBIDDEN_LOCAL) if hasattr(ds_comm, name)}

    def size(group) -> int:
        return dist.get_world_size(group) if group is not None else dist.get_world_size()

    def all_to_all_single(output, tensor, *args, group=None, **kwargs):
        records.append(CommRecord("all_to_all", size(group), tensor.numel() * tensor.element_size(), group))
        if local:
            output.copy_(tensor)
            return None
        return originals["all_to_all_single"](output, tensor, *args, group=group, **kwargs)

    def all_reduce(tensor, *args, group=None, **kwargs):
        records.append(CommRecord("all_reduce", size(group), tensor.numel() * tensor.element_size(), group))
        if local:
            tensor.copy_(tensor.clone())
            return None
        return originals["all_reduce"](tensor, *args, group=group, **kwargs)

    def refused(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"peer:{NAME}'s compute-only step met a collective it has no local copy for: {name}")
        return call

    replacements = {"all_to_all_single": all_to_all_single, "all_reduce": all_reduce}
    if local:
        replacements |= {name: refused(name) for name in _FORBIDDEN_LOCAL if name in originals}
    try:
        for name, function in replacements.items():
            setattr(ds_comm, name, function)
        yield records
    finally:
        for name, function in originals.items():
            setattr(ds_comm, name, function)


def _allow_dtypes(dtypes: set[torch.dtype]) -> None:
    """DeepSpeed's CPU accelerator lists float32 and bfloat16 as the gradient dtypes its engine may
    all-reduce (`split_half_float_double_sparse` asserts it), though the reduction itself (flatten,
    all-reduce, scale) is dtype-generic. A float64 check adds float64 to that list, so the engine's
    own reduction runs on float64 gradients; a float32 run changes nothing."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    missing = [d for d in dtypes if d.is_floating_point and d not in accelerator.supported_dtypes()]
    if missing:
        listed = accelerator.supported_dtypes
        accelerator.supported_dtypes = lambda: [*listed(), *missing]


def _rows(inputs) -> int:
    tensors = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    return int(tensors[0].shape[0])


class DeepSpeedMoEPeer:
    """The model as DeepSpeed-MoE trains it, on this rank: build on every rank, then step.

    `model` is the single-process model (the same weights on every rank), `inputs` this rank's
    batch (a tuple of tensors or a dict of keyword tensors, as `commfx.verify.local_batch`
    gives it). Training goes through DeepSpeed's engine (`deepspeed.initialize`, ZeRO stage 0,
    no mixed precision, no clipping) with torch's AdamW (`lr`, torch's other defaults, the
    bench's optimizer) over DeepSpeed's MoE parameter groups; the loss is `commfx.train.loss_fn`,
    without DeepSpeed's l_aux.

    `records` holds the collectives of the last step (all-to-alls of the MoE layers, the gate's
    capacity all-reduce, the engine's gradient all-reduces), for byte counts beside the wire's.
    """

    name = NAME
    tolerance = PEER_TOLERANCE

    def __init__(self, model: nn.Module, inputs, *, ep_size: int, lr: float, capacity_factor: float = 1.0,
                 drop_tokens: bool = False):
        deepspeed = _deepspeed()
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        self.inputs = inputs
        self.module = _rebuild(model, ep_size=ep_size, capacity_factor=capacity_factor, drop_tokens=drop_tokens,
                               attach_groups=False)  # the engine attaches the expert groups itself
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in self.module.parameters() if p.requires_grad], "name": "parameters"})
        optimizer = torch.optim.AdamW(groups, lr=lr)
        rows = _rows(inputs)
        config = {
            "train_micro_batch_size_per_gpu": rows,
            "gradient_accumulation_steps": 1,
            "train_batch_size": rows * dist.get_world_size(),
            "zero_optimization": {"stage": 0},
            "gradient_clipping": 0.0,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        _allow_dtypes({p.dtype for p in self.module.parameters()})
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=config)
        self.records: list[CommRecord] = []

    def _loss(self) -> torch.Tensor:
        from ...models.hf import training_forward
        from ...train import loss_fn
        from ...verify import batch_tensors, call

        with training_forward(self.module):  # an HF model builds no KV cache
            return loss_fn(call(self.engine, self.inputs), batch_tensors(self.inputs))

    def forward_backward(self) -> torch.Tensor:
        """Forward, loss and backward (gradients all-reduced by the engine), no optimizer step."""
        loss = self._loss()
        self.engine.backward(loss)
        return loss.detach()

    def train_step(self) -> torch.Tensor:
        """One training step: forward, loss, backward (the engine all-reduces gradients), AdamW step
        (the engine zeroes the gradients after it). Returns this rank's loss."""
        self.records = []
        with _deepspeed_comm(self.records, local=False):
            loss = self.forward_backward()
            self.engine.step()
        return loss

    def compute_only(self) -> torch.Tensor:
        """The same step with every collective DeepSpeed issues replaced by a local copy of the
        same size: the MoE all-to-alls copy this rank's dispatch buffer (E x capacity rows) onto
        the output, the gradient all-reduces copy the bucket onto itself. Two differences from a
        real step, both small: each layer's capacity is this rank's own largest expert load (the
        capacity all-reduce is local too) rather than the group's, and the gradients are this
        rank's unreduced ones, so the replicas drift apart a little, as any compute-only step's
        would. Any other collective raises."""
        self.records = []
        with _deepspeed_comm(self.records, local=True):
            loss = self.forward_backward()
            self.engine.step()
        return loss

    def step_bytes(self) -> dict[str, int]:
        """Payload bytes of the last step's collectives by kind: the tensors handed to them (an
        all-to-all's includes the share a rank keeps). A collective over a group of one rank
        (the expert-data-parallel all-reduce when ep_size is the world size) sends nothing and
        is left out."""
        totals: dict[str, int] = {}
        for record in self.records:
            if record.group_size > 1:
                totals[record.kind] = totals.get(record.kind, 0) + record.nbytes
        return totals


# --- the equality check ------------------------------------------------------------------------------------------


def check_deepspeed_moe(model: nn.Module, global_inputs, *, ep_size: int, lr: float = 1e-2, capacity_factor: float = 1.0,
                        drop_tokens: bool = False, dtype: torch.dtype | None = torch.float64) -> PeerCheck:
    """Prove the peer computes the single-process model's function (call on every rank; collective).

    In `dtype` (float64 by default; None keeps the model's), the peer on this rank's share of
    `global_inputs` (`commfx.verify.local_batch`, which must split evenly) against the
    single-process model on the whole batch, over one training step (see
    :class:`~commfx.bench.peers.common.PeerCheck`): this rank's outputs against the reference's
    rows, the mean of the ranks' losses against the reference loss, every gradient after the
    engine's all-reduce against the reference's (each expert against its slice), all judged
    at :data:`PEER_TOLERANCE` (DeepSpeed's float32 gate); every parameter after the engine's
    AdamW step (`lr`) against the model's initial one stepped by torch's AdamW from the peer's
    gradient, at :data:`STEP_TOLERANCE`; and, reported, against the model's own step (AdamW's
    first step divides by |g| + eps, so it magnifies the gate's float32 rounding of gradient
    entries near zero: 8e-6 to 4e-5 relative on the tested models, not judged).
    Differences are relative to each reference tensor's largest entry, the maximum over ranks.
    With `drop_tokens=True` the notes count the assignments DeepSpeed dropped; any drop makes
    the peer another function than the model."""

    from ...models.hf import choose_experts_implementation, training_forward
    from ...train import loss_fn
    from ...verify import batch_tensors, call, local_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    if _rows(global_inputs) % world:
        raise ValueError(f"check_deepspeed_moe needs a batch of {_rows(global_inputs)} rows to split evenly over {world} ranks "
                         "(DeepSpeed averages the ranks' gradients, which is the global-batch gradient only for equal shares)")
    reference = copy.deepcopy(model)
    if dtype is not None:
        reference = reference.to(dtype)
    choose_experts_implementation(reference)  # an HF model's default grouped_mm cannot run float64
    inputs = local_batch(global_inputs, world, rank)
    peer = DeepSpeedMoEPeer(reference, inputs, ep_size=ep_size, lr=lr, capacity_factor=capacity_factor, drop_tokens=drop_tokens)
    ref = reference_step(reference, global_inputs, lr)

    with training_forward(peer.module):
        out = call(peer.engine, inputs)
    loss = loss_fn(out, batch_tensors(inputs))
    peer.engine.backward(loss)
    blocks = moe_blocks(peer.module)
    sources = parameter_sources(peer.module)

    def source(name: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        model_name, expert = sources[name]
        return values[model_name] if expert is None else values[model_name][expert]

    check = PeerCheck(NAME, PEER_TOLERANCE, PEER_TOLERANCE_REASON, step_tolerance=STEP_TOLERANCE)
    score_forward(check, out, loss, ref)
    named = dict(peer.module.named_parameters())
    check.grad_diffs = {n: relative_diff(p.grad, source(n, ref.grads)) for n, p in named.items()}
    # The model's initial parameters, stepped by torch's AdamW from the peer's gradients.
    stepped = {n: nn.Parameter(source(n, ref.initial).clone()) for n in named}
    for n, p in stepped.items():
        p.grad = named[n].grad.detach().clone()
    torch.optim.AdamW(stepped.values(), lr=lr).step()
    peer.engine.step()
    check.step_diffs = {n: relative_diff(p, stepped[n]) for n, p in named.items()}
    check.model_step_diffs = {n: relative_diff(p, source(n, ref.stepped)) for n, p in named.items()}
    (dropped,) = worst_over_ranks(check, extra=(float(sum(b.dropped for b in blocks)),))
    dropped = int(dropped)
    kinds = sorted({b.spec.kind for b in blocks})
    check.notes.append(f"{len(blocks)} MoE blocks ({', '.join(kinds)}) as DeepSpeed MoE layers, ep_size={ep_size}, "
                       f"{'drop_tokens=True, capacity_factor=' + format(capacity_factor, 'g') if drop_tokens else 'dropless'}")
    if drop_tokens:
        check.notes.append(f"assignments dropped for capacity on the most-dropping rank: {dropped}"
                           + ("" if dropped == 0 else " (DeepSpeed drops otherwise than commfx: not the same function)"))
    return check


Runner = DeepSpeedMoEPeer  # the names every peer module gives the bench
check = check_deepspeed_moe
