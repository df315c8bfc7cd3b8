"""Functions the pipeline tests run on every rank (imported by the worker processes)."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from commfx.api import distribute
from commfx.models import load_model
from commfx.plan import Plan


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class FirstStage(nn.Module):
    """gpt-moe's embeddings and layer 0, under the model's own parameter names."""

    def __init__(self, model):
        super().__init__()
        self.embed, self.pos = model.embed, model.pos
        self.layers = nn.ModuleDict({"0": model.layers[0]})

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.layers["0"](h)


class LastStage(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.layers = nn.ModuleDict({"1": model.layers[1]})
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, h):
        return self.lm_head(self.ln_f(self.layers["1"](h)))


def against_torch_pipelining(rank: int, world_size: int, microbatches: int) -> dict:
    """Loss and gradients of commfx's pipeline and torch.distributed.pipelining's schedule
    (PipelineStage + ScheduleGPipe / Schedule1F1B) on the same model and micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=4, seq=8)
    out = {}
    for schedule, torch_schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours = copy.deepcopy(model)
        plan = Plan.from_cli(f"lift,pipeline_split:schedule={schedule};microbatches={microbatches}", world_size=2, pp=2)
        dm = distribute(ours, plan, (ids,))
        result = dm.step(ids, loss_fn=lambda outputs, mb: lm_loss(outputs, mb.inputs[0]))
        theirs = copy.deepcopy(model)
        stage_module = FirstStage(theirs) if rank == 0 else LastStage(theirs)
        stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
        runner = torch_schedule(stage, microbatches, loss_fn=lm_loss)
        losses = []
        if rank == 0:
            runner.step(ids)
        else:
            runner.step(target=ids, losses=losses)
        out[schedule] = {
            "ours_losses": [l.detach() for l in result.losses],
            "their_losses": [l.detach() for l in losses],
            "ours": {n: p.grad.clone() for n, p in dm.module.named_parameters()},
            "theirs": {n: p.grad.clone() for n, p in stage_module.named_parameters()},
        }
    return out


def checkpoint_codec_state(rank: int, world_size: int, passes: str) -> dict:
    """Two steps, a state_dict round trip, and the codec state it carries."""
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=4, seq=8)
    dm = distribute(model, Plan.from_cli(passes, world_size=2, pp=2), (ids,))
    for _ in range(2):
        dm.scheduler.stats.reset()  # the second step's bytes: no shape header
        dm.step(ids, loss_fn=lambda outputs, mb: lm_loss(outputs, mb.inputs[0]))
    stats = dm.scheduler.stats
    sent = {kind: stats.intra_node_bytes[kind] + stats.inter_node_bytes[kind] for kind in ("pp_forward", "pp_backward")}
    state = dm.state_dict()
    saved = {k: v.clone() for k, v in dm.codec_state.get(0, {}).items()}
    dm.codec_state = {}
    dm.load_state_dict(state)
    restored = dm.codec_state.get(0, {})
    return {"saved": saved, "restored": restored, "stage": dm.stage_index, "bytes": sent}


def dp_powersgd(rank: int, world_size: int) -> dict:
    """DataParallelPowerSGD over the world: a gradient whose sum has rank <= r is reduced
    exactly; with error feedback the reduced sum stays one residual behind the exact sum."""
    import torch.distributed as dist

    from commfx.ops.powersgd_allreduce import DataParallelPowerSGD

    def all_reduce(t):
        dist.all_reduce(t)
        return t

    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own gradients
    shared = torch.Generator().manual_seed(7)  # the same on every rank
    out = {}
    # rank(sum_i M_i) <= 3: every rank's gradient lies in one 3-dimensional column space,
    # and each expert of a stack in a column space of its own
    basis = torch.randn(24, 3, generator=shared, dtype=torch.float64)
    expert_bases = torch.randn(2, 24, 3, generator=shared, dtype=torch.float64)
    low = {
        "w": basis @ torch.randn(3, 10, generator=generator, dtype=torch.float64),
        "experts": expert_bases @ torch.randn(2, 3, 10, generator=generator, dtype=torch.float64),
    }
    exact = {name: all_reduce(g.clone()) / world_size for name, g in low.items()}
    got = DataParallelPowerSGD(3, error_feedback=False).reduce(low, {}, all_reduce, world_size, 1.0 / world_size)
    out["low_rank_diff"] = max((got[n] - exact[n]).abs().max().item() for n in low)
    out["shapes"] = {n: tuple(got[n].shape) for n in got}
    # A persistent rank-4 signal plus noise, at rank 2: feedback keeps the running sum one
    # residual behind; without it the directions rank 2 drops pile up every step.
    signal = torch.randn(24, 4, generator=shared, dtype=torch.float64) @ torch.randn(4, 16, generator=shared, dtype=torch.float64)
    for error_feedback in (True, False):
        codec, state = DataParallelPowerSGD(2, error_feedback=error_feedback), {}
        sent_sum = torch.zeros(24, 16, dtype=torch.float64)
        true_sum = torch.zeros(24, 16, dtype=torch.float64)
        worst = 0.0
        for _ in range(20):
            m = signal + 0.1 * torch.randn(24, 16, generator=generator, dtype=torch.float64)
            sent_sum += codec.reduce({"w": m}, state, all_reduce, world_size, 1.0 / world_size)["w"]
            true_sum += all_reduce(m.clone()) / world_size
            if error_feedback:
                errors = all_reduce(state["error.w"].clone()) / world_size  # scale x sum_i E_i
                worst = max(worst, (true_sum - sent_sum - errors).abs().max().item())
        out[f"drift {error_feedback}"] = (true_sum - sent_sum).norm().item()
        if error_feedback:
            out["telescoping"] = worst
        out[f"q {error_feedback}"] = state["q.w"]
    return out


def selective_dp_compression(rank: int, world_size: int, passes: str) -> dict:
    """pp=2 x dp=2, one step uncompressed and one with `passes`: each stage's gradients, the
    dp codec's residuals averaged over the dp group, the gradient bytes, and the codec state
    through a state_dict round trip."""
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=8, seq=8)
    out = {}
    for name, plan in (("exact", "lift,pipeline_split"), ("compressed", passes)):
        dm = distribute(copy.deepcopy(model), Plan.from_cli(plan, world_size=4, pp=2), (ids,))
        dm.scheduler.stats.reset()
        dm.step(ids, loss_fn=lambda outputs, mb: lm_loss(outputs, mb.inputs[0]))
        stats = dm.scheduler.stats
        out[name] = {
            "grads": {n: p.grad.clone() for n, p in dm.module.named_parameters() if p.grad is not None},
            "bytes": {k: stats.intra_node_bytes[k] + stats.inter_node_bytes[k] for k in ("grad_all_reduce", "grad_powersgd")},
        }
    errors = {k.removeprefix("error."): v for k, v in dm.dp_codec_state.items() if k.startswith("error.")}
    dp = dm.scheduler.group("dp").size
    out["mean_errors"] = {n: dm.scheduler.all_reduce(e.clone(), "dp").view(out["compressed"]["grads"][n].shape) / dp for n, e in errors.items()}
    out["compressed_names"] = [name for name, _ in dm.dp_compressed]
    saved = {k: v.clone() for k, v in dm.dp_codec_state.items()}
    state = dm.state_dict()
    dm.dp_codec_state = {}
    dm.load_state_dict(state)
    out.update(stage=dm.stage_index, saved=saved, restored={k: v.clone() for k, v in dm.dp_codec_state.items()})
    return out
