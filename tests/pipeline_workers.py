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
