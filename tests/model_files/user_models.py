"""Model files as a new user writes them, right and wrong, for the CLI's checks (issue 27).

Features models take float activations [batch, seq, hidden] (no embedding); the others wrap
the built-in gpt-moe-tiny. Rank-dependent mistakes are made in `build` from the process
group (as tests/model_files/perturbed_router.py does), so the single-process reference and
the CLI's preflight see the model as written and only the distributed run differs.
"""

import torch
import torch.distributed as dist
from torch import nn

from commfx.models import load_model

HIDDEN = 16


class FeaturesMoE(nn.Module):
    """gpt-moe-tiny's decoder layers over float features; `shift` is added to the output."""

    def __init__(self, layers: nn.ModuleList, exp: bool = False):
        super().__init__()
        self.layers = layers
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.register_buffer("shift", torch.zeros(()))
        self.exp = exp  # exponentiate the features first (large ones overflow)

    def forward(self, features):
        h = features.exp() if self.exp else features
        for layer in self.layers:
            h = layer(h)
        return self.ln_f(h) + self.shift


def features(batch: int = 4, seq: int = 8, shift_on_rank1: float = 0.0):
    model, _ = load_model("gpt-moe-tiny")
    torch.manual_seed(1)
    wrapped = FeaturesMoE(model.layers)
    if dist.is_initialized() and dist.get_rank() == 1:
        wrapped.shift.fill_(shift_on_rank1)
    return wrapped, (torch.randn(batch, seq, HIDDEN),)


def adds_rank():
    """A wrong distributed run: rank 1's outputs are off by one (verify must FAIL)."""
    return features(shift_on_rank1=1.0)


def nan_on_rank1():
    """NaN only in the distributed run, on rank 1."""
    return features(shift_on_rank1=float("nan"))


def overflows_on_rank1():
    """exp() of rank 1's rows (the second half of the batch) overflows: inf, then NaN."""
    model, (x,) = features()
    model.exp = True
    x[2:] = x[2:].abs() * 1e3
    return model, (x,)


def nan_features():
    model, (x,) = features()
    x[2, 3, 5] = float("nan")
    return model, (x,)


def nan_weights():
    model, (ids,) = load_model("gpt-moe-tiny", batch=4)
    with torch.no_grad():
        model.lm_head.weight[3, 1] = float("nan")
    return model, (ids,)


def keywords():
    """The README's dict form of inputs."""
    model, (ids,) = load_model("gpt-moe-tiny", batch=4)
    return model, {"input_ids": ids}


def one_row():
    """A global batch of one row: on two ranks, rank 1 gets none."""
    model, (ids,) = load_model("gpt-moe-tiny", batch=1)
    return model, (ids,)


def float_ids():
    model, (ids,) = load_model("gpt-moe-tiny", batch=4)
    return model, (ids.float(),)


class RaisesOnRank1(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("rank 1's shard of the data is corrupt")
        return self.inner(input_ids)


class Raises(RaisesOnRank1):
    def forward(self, input_ids):
        raise ValueError("forward is not written yet")


def raises():
    model, (ids,) = load_model("gpt-moe-tiny", batch=4)
    return Raises(model), (ids,)


def raises_on_rank1():
    model, (ids,) = load_model("gpt-moe-tiny", batch=4)
    return RaisesOnRank1(model), (ids,)


class NamedBlocks(nn.Module):
    """gpt-moe-tiny with two decoder layers kept as attributes `first` and `second`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.embed, self.pos, self.ln_f, self.lm_head = inner.embed, inner.pos, inner.ln_f, inner.lm_head
        self.first, self.second = inner.layers

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.second(self.first(self.embed(input_ids) + self.pos(positions)))
        return self.lm_head(self.ln_f(h))


def named_blocks():
    model, (ids,) = load_model("gpt-moe-tiny", batch=4, num_layers=2)
    return NamedBlocks(model), (ids,)


def _hf():
    from commfx.models.hf import build_hf_moe

    model, (ids,) = build_hf_moe("mixtral", batch=4, seq=8)
    return model, ids


def hf_labels():
    """The README's HF form: input_ids and labels by keyword."""
    model, ids = _hf()
    return model, {"input_ids": ids, "labels": ids}


def hf_typo():
    model, ids = _hf()
    return model, {"input_idz": ids, "labels": ids}


def hf_label():
    model, ids = _hf()
    return model, {"input_ids": ids, "label": ids}


def tiny_keywords():
    """gpt-moe-tiny's own batch in the README's dict form."""
    model, (ids,) = load_model("gpt-moe-tiny")
    return model, {"input_ids": ids}
