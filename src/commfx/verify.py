"""Equivalence check: the distributed rewrite against a single-process reference, in float64.

Every rank runs the rewritten model on its slice of the global batch (split along dim 0,
unevenly when it does not divide) and backpropagates loss = sum(output * probe), where the
probe is a fixed random tensor of the global output's shape. The reference runs the
original model on the whole batch with the same loss (scaled by 1/world under `mean`
gradient reduction, which is what the runtime's gradient averaging computes). Outputs and
every gradient must agree to the tolerance.

Under shard_states:stage=2|3 backward leaves each rank only its shard of each reduced gradient
(scaled as the replicated all-reduce scales it). Each rank makes the plan's sharded optimizer
(its gradients are what that optimizer steps with), and after backward the slices it would
step with are assembled, from every rank of each bucket's group, into the rank's whole
gradient (`sharded_gradients`): what the replicated plan leaves in `.grad`, so a wrong shard
fails its parameter's comparison, and ranks in different groups still hold replicas to agree.

In capacity mode dropping depends on each rank's own batch, so the reference is the
single-process capacity graph (lift + capacity dispatch, no communication) applied to each
rank's slice; dropless mode is checked against the untouched original model.

Where the model itself computes a parameter's region in a coarser dtype (DeepSeek's float32
router in a float64 run; `compiler.precision` finds these from the casts in the graph), that
parameter's gradient is a float32 sum over tokens whose rounding depends on how tokens are
split over ranks. It is judged at LOW_PRECISION_MARGIN x that dtype's epsilon x the size of
the reference gradient, and the report says which tensors were judged so and why. Outputs
and every other gradient keep the tolerance (the per-token float32 computations are the same
in both runs, so they agree exactly).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from .models import load_model
from .models.hf import choose_experts_implementation, training_forward
from .passes import plan_options
from .compiler.pass_manager import no_op_passes, rewrite_census
from .batches import batch_tensors, call, data_share, local_batch, pipeline_step, split_batch  # noqa: F401  (the doors' batch helpers, re-exported)
from .plan import Plan
from .tolerances import MIXED_PRECISION_FORMULA, mixed_precision_tolerance  # noqa: F401  (re-exported)

DEFAULT_TOLERANCE = 1e-10
# Summing n float32 terms in another order changes the result by at most ~n * eps relative
# to the terms; tiny test batches have n <= 64 tokens per expert, and reductions in two halves
# stay well inside 64 eps of the largest gradient entry.
LOW_PRECISION_MARGIN = 64.0


@dataclass
class VerifyCase:
    model: str
    plan: Plan
    batch: int | None = None
    seq: int | None = None
    seed: int = 0
    starve_expert: int | None = None  # force this expert to receive no tokens (built-in router)

    def model_kwargs(self) -> dict:
        return {k: v for k, v in (("batch", self.batch), ("seq", self.seq)) if v is not None}


@dataclass
class VerifyReport:
    case: VerifyCase
    output_diff: float
    grad_diffs: dict[str, float]
    replica_diff: float  # largest disagreement between ranks on a replicated gradient
    tolerance: float
    tokens_per_rank: list[int] = field(default_factory=list)
    empty_experts: list[str] = field(default_factory=list)
    rows_per_rank: list[int] = field(default_factory=list)  # sequences (dim 0 of the inputs) each rank had
    # the first non-finite output or gradient of each rank that has one: 'output 0 on rank 1 (nan)'
    not_finite: list[str] = field(default_factory=list)
    # gradient name -> (its own tolerance, why): parameters the model computes in a coarser dtype
    low_precision: dict[str, tuple[float, str]] = field(default_factory=dict)
    # pass -> what it left in the distributed graph, counted (rank 0's; see Pass.evidence)
    rewrites: dict[str, dict[str, int]] = field(default_factory=dict)
    # mixed precision (Plan.precision): the outputs' own tolerance, the formula every
    # tolerance came from, and the run's differences from the float32 model (not judged)
    precision: str = "fp32"
    output_tolerance: float | None = None
    tolerance_formula: str = ""
    full_precision_diffs: dict[str, float] = field(default_factory=dict)

    @property
    def max_diff(self) -> float:
        return worst([self.output_diff, self.replica_diff, *self.grad_diffs.values()])

    @property
    def outputs_tolerance(self) -> float:
        return self.tolerance if self.output_tolerance is None else self.output_tolerance

    def tolerance_of(self, name: str) -> float:
        return self.low_precision[name][0] if name in self.low_precision else self.tolerance

    @property
    def failures(self) -> list[str]:
        """What is over its tolerance; NaN is never within one (`not diff <= tolerance`)."""
        bad = [name for name, diff in self.grad_diffs.items() if not diff <= self.tolerance_of(name)]
        if not self.output_diff <= self.outputs_tolerance:
            bad.insert(0, "outputs")
        if not self.replica_diff <= self.tolerance:
            bad.append("replicated grads across ranks")
        bad[:0] = [f"not finite: {what}" for what in self.not_finite]
        bad.extend(f"pass {name} changed nothing" for name in no_op_passes(self.rewrites))
        return bad

    @property
    def ok(self) -> bool:
        return not self.failures


def case_dtype(case: VerifyCase) -> torch.dtype:
    """The parameters' dtype: float64 for the exact check; float32 masters under mixed precision."""
    return torch.float64 if case.plan.precision == "fp32" else torch.float32


def build_case_model(case: VerifyCase, dtype: torch.dtype | None = None):
    model, inputs = load_model(case.model, seed=case.seed, dtype=dtype or case_dtype(case), **case.model_kwargs())
    choose_experts_implementation(model)  # an HF model's default grouped_mm cannot run float64
    if case.starve_expert is not None:
        starved = 0
        for module in model.modules():
            if hasattr(module, "logit_bias"):
                module.logit_bias[case.starve_expert] = -1e4
                starved += 1
        if not starved:
            raise ValueError(f"{case.model} has no router logit_bias buffer to starve an expert with")
    return model, inputs


class NonFiniteError(ValueError):
    """A NaN or inf where training or verifying needs numbers: never a pass."""


def not_finite(named) -> tuple[str, str] | None:
    """(name, 'nan' or 'inf') of the first floating tensor of (name, tensor) pairs that is not finite."""
    for name, tensor in named:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name, "nan" if bool(tensor.isnan().any()) else "inf"
    return None


def worst(values) -> float:
    """The largest of `values`, NaN if any is NaN (Python's max() hides a NaN after the first value)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (NaN if either holds NaN); 0 for empty tensors (a rank without rows)."""
    diff = (a - b).abs()
    return diff.max().item() if diff.numel() else 0.0


def preflight(model: torch.nn.Module, plan: Plan, global_inputs) -> None:
    """Compile the smallest share of the batch here, in one process: what would fail on every
    rank (the plan, a capture error, a graph break, an unsupported model), or on the rank with
    the fewest sequences (too few to cut into micro-batches), fails once, before any rank is
    spawned, with the message and no traceback."""
    from .compiler.pipeline import compile_program

    plan.validate()  # the topology first: the batch is cut by it
    check_numbers(model, global_inputs)
    smallest = local_batch(global_inputs, *data_share(plan, plan.topology.world_size - 1))
    rows = batch_tensors(smallest)[0].shape[0]
    compile_program(model, plan, smallest if rows else local_batch(global_inputs, *data_share(plan, 0)))


def check_numbers(model: torch.nn.Module, inputs) -> None:
    """NaN in the inputs or in a buffer, NaN or inf in a parameter, is an error before anything
    runs: every result computed from it would be NaN (an input or buffer may hold inf on
    purpose, as an additive mask)."""
    from .compiler.inputs import input_names

    named = [(f"input {name}", t, False) for name, t in zip(input_names(model, inputs), batch_tensors(inputs))]
    named += [(f"parameter {n}", p, True) for n, p in model.named_parameters()]
    named += [(f"buffer {n}", b, False) for n, b in model.named_buffers()]
    for what, tensor, inf_too in named:
        if not tensor.is_floating_point():
            continue
        bad = ~torch.isfinite(tensor) if inf_too else torch.isnan(tensor)
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]] if tensor.dim() else []
            kind = "NaN" if bool(tensor.isnan().any()) else "inf"
            raise NonFiniteError(
                f"{what} holds {kind} (first at {first}; {int(bad.sum())} of {tensor.numel()} values): every "
                "output, loss and gradient computed from it would be NaN. Fix the model file or its data "
                "(torch.isnan(t).nonzero() lists them)."
            )


def probes(outputs: list[torch.Tensor], rows: int | list[int], seed: int) -> list[torch.Tensor]:
    """Fixed random tensors shaped like `outputs`, with `rows` rows (one count, or one per output)."""
    generator = torch.Generator().manual_seed(seed + 12345)
    counts = rows if isinstance(rows, list) else [rows] * len(outputs)
    return [torch.randn((n, *o.shape[1:]), generator=generator, dtype=o.dtype).to(o.device) for n, o in zip(counts, outputs)]


def per_rank(outputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
    """A scalar output is a loss over the rank's batch (an HF model's with labels=): each as one
    row, so the ranks' rows stack to one loss per data shard, what data parallelism averages;
    batched outputs (logits beside it) keep their rows. Returns (outputs, which are losses)."""
    return [o.reshape(1) if o.dim() == 0 else o for o in outputs], [o.dim() == 0 for o in outputs]


def probe_rows(losses: list[bool], shards: int, global_rows: int) -> list[int]:
    """Rows of each output's probe: one per data shard for a loss, the global batch's otherwise."""
    return [shards if loss else global_rows for loss in losses]


def batch_size(inputs) -> tuple[int, int]:
    """(rows, tokens) of a batch: sequences along dim 0, and tokens (every id of integer
    inputs; [batch, seq, hidden] features count batch x seq)."""
    from .compiler.capture import tokens_of

    tensors = batch_tensors(inputs)
    return tensors[0].shape[0], tokens_of(tuple(tensors))


def verify_worker(rank: int, world_size: int, cases: list[VerifyCase], device: str = "cpu") -> list[dict]:
    """Run on every rank by the launcher: one result per case (on `device`; results back on the CPU)."""
    from torch.utils import _pytree as pytree

    from .api import distribute
    from .runtime.pipeline.module import PipelineModule

    results = []
    for case in cases:
        model, inputs = build_case_model(case)
        model, parts, part = model.to(torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"), *data_share(case.plan, rank)
        local = pytree.tree_map_only(torch.Tensor, lambda t: t.to(next(model.parameters()).device), local_batch(inputs, parts, part))
        # Every value is compared with the reference, so a replica that differs fails by its numbers.
        dm = distribute(model, case.plan, local, replicas="off")
        optimizer = sharded_optimizer(dm)
        global_rows = batch_tensors(inputs)[0].shape[0]
        rows, tokens = batch_size(local)
        if isinstance(dm, PipelineModule):
            results.append(_verify_pipeline(dm, local, global_rows, parts, part, case.seed, optimizer))
            results[-1].update(rows=rows, tokens=tokens, rewrites=rewrite_census(dm.program, case.plan))
            continue
        outputs, losses = per_rank(pytree.tree_flatten(call(dm, local))[0])
        mine = [split_batch(p, parts, part) for p in probes(outputs, probe_rows(losses, parts, global_rows), case.seed)]
        loss = sum((o * p).sum() for o, p in zip(outputs, mine))
        loss.backward()
        results.append(
            {
                "outputs": [o.detach().cpu() for o in outputs],
                "grads": rank_gradients(dm, optimizer),
                "placement": dm.placement,
                "rows": rows,
                "tokens": tokens,
                "rewrites": rewrite_census(dm.program, case.plan),
            }
        )
    return results


def sharded_optimizer(dm) -> torch.optim.Optimizer | None:
    """The plan's sharded optimizer (never stepped) where shard_states:stage=2|3 keeps only
    shards of the reduced gradients, which it must exist to receive; None otherwise."""
    from .runtime.sharded_optimizer import shard_optimizer
    from .runtime.state_shards import ShardedGradSync

    sync = getattr(dm, "grad_sync", None)
    if isinstance(sync, ShardedGradSync) and sync.stage >= 2:
        return shard_optimizer(dm, torch.optim.SGD, lr=0.0)
    return None


def sharded_gradients(dm, optimizer) -> dict[str, torch.Tensor]:
    """name -> this rank's whole reduced gradient of each parameter shard_states:stage=2|3
    left in shards: each rank's slices of it, as the sharded optimizer steps them, taken as
    chunks of the parameter (`checkpoint.chunks.flat_chunks`) and assembled from the ranks of
    the bucket's group (`checkpoint.gather.assemble`). Collective."""
    from .checkpoint.chunks import flat_chunks
    from .checkpoint.gather import assemble

    names = {id(p): n for n, p in dm.module.named_parameters()}
    mine, groups = {}, {}
    for param, shard, slot, lo, hi, _ in optimizer._parts:
        if shard is None:  # outside the buckets: its .grad is whole
            continue
        name, shape = names[id(param)], tuple(param.shape)
        grad = optimizer._grad(param, shard, slot, lo, hi) if hi > lo else None
        mine[name] = (shape, [] if grad is None else flat_chunks(grad.detach().cpu().clone(), shape, lo))
        groups[name] = dm.scheduler.group(shard.bucket.group).ranks
    everyone = dm.scheduler.all_gather_object(mine)
    whole = {name: assemble([everyone[rank][name] for rank in groups[name]]) for name in mine}
    return {name: grad for name, grad in whole.items() if grad is not None}


def rank_gradients(dm, optimizer) -> dict[str, torch.Tensor]:
    """name -> this rank's reduced gradient of each parameter that has one, on the CPU
    (assembled from the shards under shard_states:stage=2|3). Collective with `optimizer`."""
    grads = {n: p.grad.detach().cpu().clone() for n, p in dm.module.named_parameters() if p.grad is not None}
    if optimizer is not None:
        grads.update(sharded_gradients(dm, optimizer))
    return grads


def _verify_pipeline(dm, local, global_rows: int, parts: int, part: int, seed: int, optimizer=None) -> dict:
    """The same probe loss, per micro-batch on the last stage (summed, not averaged over
    micro-batches, so the gradients are the reference's)."""
    from torch.utils import _pytree as pytree

    def loss_fn(outputs, microbatch):
        flat = pytree.tree_flatten(outputs)[0]
        mine = [split_batch(p, parts, part)[microbatch.rows] for p in probes(flat, global_rows, seed)]
        return sum((o * p).sum() for o, p in zip(flat, mine))

    result = pipeline_step(dm, local, loss_fn=loss_fn, scale_grads=False)
    per_mb = [pytree.tree_flatten(o)[0] for o in result.outputs]
    outputs = [torch.cat([mb[i] for mb in per_mb]) for i in range(len(per_mb[0]))] if per_mb else []
    return {
        "outputs": [o.cpu() for o in outputs],
        "has_outputs": dm.is_last,
        "grads": rank_gradients(dm, optimizer),
        "placement": dm.placement,
    }


def reference(case: VerifyCase, world_size: int, *, full_precision: bool = False) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and gradients of the single-process reference (see module docstring). Under
    mixed precision, the same recipe in one process; `full_precision`: the model in float32
    without the recipe's casts (what verify reports beside it, not judged)."""
    from torch.utils import _pytree as pytree

    mixed = case.plan.precision != "fp32"
    model, inputs = build_case_model(case, dtype=torch.float32 if full_precision else None)
    scale = case.plan.grad_scale  # the distributed run checks its world is the plan's
    capacity = plan_options(case.plan, "expert_parallel").capacity_factor if "expert_parallel" in case.plan.pass_names() else 0.0
    if mixed and not full_precision:
        return _capacity_reference(case, model, inputs, case.plan.topology.dp, scale, capacity, case.plan.precision)
    if capacity <= 0:
        with training_forward(model):
            outputs, _ = pytree.tree_flatten(call(model, inputs))
        if any(o.dim() == 0 for o in outputs):  # the model returns its loss: one per data shard
            return _per_shard_reference(case, model, inputs, case.plan.topology.dp, scale)
        loss = sum((o * p).sum() for o, p in zip(outputs, probes(outputs, batch_tensors(inputs)[0].shape[0], case.seed)))
        (loss * scale).backward()
        return [o.detach() for o in outputs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return _capacity_reference(case, model, inputs, case.plan.topology.dp, scale, capacity)


def _per_shard_reference(case, model, inputs, shards, scale):
    """A model that returns its own loss: each data shard's loss, as data parallelism sees it
    (a shard without rows contributes a zero loss and no rows, as its rank does)."""
    from torch.utils import _pytree as pytree

    model.zero_grad(set_to_none=True)
    pieces: dict[int, list[torch.Tensor]] = {}
    with training_forward(model):
        for rank in range(shards):
            local = local_batch(inputs, shards, rank)
            if batch_tensors(local)[0].shape[0]:
                pieces[rank], losses = per_rank(pytree.tree_flatten(call(model, local))[0])
    some = next(iter(pieces.values()))
    empty = [o.new_zeros((1 if loss else 0, *o.shape[1:])) for o, loss in zip(some, losses)]
    outputs = [torch.cat([pieces.get(rank, empty)[i] for rank in range(shards)]) for i in range(len(some))]
    rows = probe_rows(losses, shards, batch_tensors(inputs)[0].shape[0])
    loss = sum((o * p).sum() for o, p in zip(outputs, probes(outputs, rows, case.seed)))
    (loss * scale).backward()
    return [o.detach() for o in outputs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _capacity_reference(case, model, inputs, shards, scale, capacity, precision: str = "fp32"):
    """The single-process lifted graph, no communication. With capacity, on each rank's slice
    (dropping depends on it); under mixed precision, the same recipe (`precision`'s casts) on
    the whole batch when nothing is dropped."""
    from torch.utils import _pytree as pytree

    from .compiler.pipeline import compile_program
    from .passes.expert_parallel import set_capacity
    from .plan import PassSpec, Topology
    from .runtime.comm import install_default, local_scheduler

    passes = (PassSpec("lift"),)
    if precision != "fp32" and "expert_parallel" in case.plan.pass_names() and plan_options(case.plan, "expert_parallel").dispatch == "fp8":
        # fp8 dispatch quantises each row on its own: one process quantises the same rows alike
        # (the float32 model beside it has neither the casts nor the codec)
        passes += (PassSpec("expert_parallel", {"dispatch": "fp8"}),)
    single = Plan(Topology(world_size=1), passes, precision=precision)
    program = compile_program(copy.deepcopy(model), single, local_batch(inputs, shards, 0))
    if capacity > 0:
        set_capacity(program, capacity)
    else:
        shards = 1
    install_default(local_scheduler())
    pieces = []
    for rank in range(shards):
        local = local_batch(inputs, shards, rank)
        graph_inputs = [local[name] for name in program.input_names] if isinstance(local, dict) else local
        pieces.append(list(program.gm(*graph_inputs)))
    outputs = [torch.cat([piece[i] for piece in pieces]) for i in range(len(pieces[0]))]
    loss = sum((o * p).sum() for o, p in zip(outputs, probes(outputs, batch_tensors(inputs)[0].shape[0], case.seed)))
    (loss * scale).backward()
    grads = {n: p.grad for n, p in program.gm.named_parameters() if p.grad is not None}
    outputs, _ = pytree.tree_flatten(outputs)
    return [o.detach() for o in outputs], grads


def low_precision_tolerances(case: VerifyCase, ref_grads: dict[str, torch.Tensor], tolerance: float) -> dict[str, tuple[float, str]]:
    """Gradients of parameters the model computes in a coarser dtype: their tolerance and why."""
    from .compiler.capture import capture
    from .compiler.precision import low_precision_parameters

    model, inputs = build_case_model(case)
    found = low_precision_parameters(capture(model, inputs).gm, case_dtype(case))
    judged = {}
    for name, low in found.items():
        if name in ref_grads:
            eps = torch.finfo(low.dtype).eps
            scale = max(1.0, ref_grads[name].abs().max().item())
            judged[name] = (
                max(tolerance, LOW_PRECISION_MARGIN * eps * scale),
                f"{low.reason} by the model: {LOW_PRECISION_MARGIN:g} x eps({str(low.dtype).removeprefix('torch.')}) x {scale:.3g}",
            )
    return judged


def checked_reference(case: VerifyCase, world_size: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The reference, which must be finite: if the model as given computes NaN or inf on the
    whole batch, there is nothing to compare the distributed run with."""
    ref_outputs, ref_grads = reference(case, world_size)
    found = not_finite([*((f"output {i}", o) for i, o in enumerate(ref_outputs)), *((f"grad {n}", g) for n, g in ref_grads.items())])
    if found:
        raise NonFiniteError(
            f"the single-process reference is not finite: {found[0]} ({found[1]}). The model as given (float64, the "
            "whole batch, no commfx) computes it, so there is nothing to verify against; fix the model or its inputs."
        )
    return ref_outputs, ref_grads


def ranks_not_finite(rank_results: list[dict]) -> list[str]:
    """'output 0 on rank 1 (nan)': the first non-finite value of each rank that has one, outputs
    before gradients (a gradient all-reduce spreads one rank's NaN to every rank)."""
    found: dict[int, str] = {}
    for kind in ("output", "grad"):
        for rank, result in enumerate(rank_results):
            named = enumerate(result["outputs"]) if kind == "output" else result["grads"].items()
            first = not_finite((f"{kind} {name}", t) for name, t in named)
            if first and rank not in found:
                found[rank] = f"{first[0]} on rank {rank} ({first[1]})"
    return list(found.values())


def compare(
    case: VerifyCase, rank_results: list[dict], world_size: int, tolerance: float, ref: tuple | None = None,
    full_precision: tuple | None = None,
) -> VerifyReport:
    """The distributed run against the reference. Under mixed precision every output and
    gradient is judged at `mixed_precision_tolerance`, and `full_precision` (the float32
    model's outputs and gradients) gives the differences reported beside them."""
    from .compiler.sharding import assemble

    ref_outputs, ref_grads = ref if ref is not None else reference(case, world_size)
    topology = case.plan.topology
    tp = topology.tp
    with_outputs = [r for r in rank_results if r.get("has_outputs", True)]  # a pipeline's last stages
    # One rank per data shard gives the global output; the others of its tp group must agree.
    outputs = [torch.cat([r["outputs"][i] for r in with_outputs[::tp]]) for i in range(len(ref_outputs))]
    output_diff = worst(max_abs_diff(o, r) for o, r in zip(outputs, ref_outputs))
    for i, result in enumerate(with_outputs):
        lead = with_outputs[i // tp * tp]
        output_diff = worst([output_diff] + [max_abs_diff(a, b) for a, b in zip(result["outputs"], lead["outputs"])])
    ep = topology.expert_parallel_size
    grad_diffs, replica_diff, assembled = {}, 0.0, {}
    for name, ref in ref_grads.items():
        holders = [r for r in rank_results if name in r["grads"]]  # every rank, or one stage's ranks
        if not holders:
            continue
        placement = holders[0]["placement"].get(name)
        if isinstance(placement, dict):  # tensor-parallel shard: assemble each tp group's parts
            groups = [holders[b : b + tp] for b in range(0, len(holders), tp)]
            replicas = [assemble([r["grads"][name] for r in g], [r["placement"][name] for r in g]) for g in groups]
        elif placement is not None:
            blocks = [holders[b : b + ep] for b in range(0, len(holders), ep)]
            replicas = [torch.cat([r["grads"][name] for r in block]) for block in blocks]
        else:
            replicas = [r["grads"][name] for r in holders]
        full = assembled[name] = replicas[0]
        grad_diffs[name] = max_abs_diff(full, ref)
        replica_diff = worst([replica_diff] + [max_abs_diff(x, full) for x in replicas])
    missing = set().union(*(r["grads"] for r in rank_results)) ^ set(ref_grads)
    if missing:
        raise AssertionError(f"gradients present on one side only: {sorted(missing)}")
    low_precision = low_precision_tolerances(case, ref_grads, tolerance)
    mixed: dict = {}
    if case.plan.precision != "fp32":
        ranks, tokens = topology.dp * tp, sum(r["tokens"] for r in rank_results) // (tp * topology.pp)
        formula = f"{MIXED_PRECISION_FORMULA}, R = {ranks} partial sums (data- x tensor-parallel ranks), n = {tokens} tokens"
        for name, ref in ref_grads.items():
            if name in grad_diffs:
                low_precision[name] = (max(tolerance, mixed_precision_tolerance(ref, ranks, tokens, case.plan.precision)), formula)
        mixed = {
            "precision": case.plan.precision,
            "output_tolerance": max(tolerance, worst(mixed_precision_tolerance(r, ranks, tokens, case.plan.precision) for r in ref_outputs)),
            "tolerance_formula": formula,
        }
        if full_precision is not None:
            fp_outputs, fp_grads = full_precision
            mixed["full_precision_diffs"] = {
                "outputs": worst(max_abs_diff(o, r.to(o.dtype)) for o, r in zip(outputs, fp_outputs)),
                "grads": worst(max_abs_diff(assembled[name], g.to(assembled[name].dtype)) for name, g in fp_grads.items() if name in assembled),
            }
    return VerifyReport(
        case,
        output_diff,
        grad_diffs,
        replica_diff,
        tolerance,
        [r["tokens"] for r in rank_results],
        rows_per_rank=[r["rows"] for r in rank_results],
        not_finite=ranks_not_finite(rank_results),
        low_precision=low_precision,
        rewrites=rank_results[0]["rewrites"],
        **mixed,
    )


def verify(cases: list[VerifyCase], world_size: int, *, tolerance: float = DEFAULT_TOLERANCE, timeout_s: float = 600.0, device: str = "cpu") -> list[VerifyReport]:
    """Launch `world_size` local ranks (gloo; NCCL on `device` "cuda", one GPU each), run every case, compare with the CPU reference. What
    fails without ranks (the plan, capture, a non-finite model, input or reference) fails
    here first, before any rank starts."""
    from .runtime.launcher import launch

    references, full_precision = [], []
    for case in cases:
        if case.plan.topology.world_size != world_size:
            raise ValueError(f"case {case.model} has a plan for world size {case.plan.topology.world_size}, not {world_size}")
        model, inputs = build_case_model(case)
        preflight(model, case.plan, inputs)
        references.append(checked_reference(case, world_size))
        full_precision.append(reference(case, world_size, full_precision=True) if case.plan.precision != "fp32" else None)
    collective_timeout_s = max(case.plan.collective_timeout_s for case in cases)
    results = launch("commfx.verify:verify_worker", world_size, {"cases": cases, "device": device}, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s, device=device)
    return [
        compare(case, [r[i] for r in results], world_size, tolerance, references[i], full_precision[i]) for i, case in enumerate(cases)
    ]
