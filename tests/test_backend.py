"""torch.compile(model, backend=commfx.backend(plan)) equals eager / the float64 reference,
on 1 and 2 ranks, with and without graph breaks."""

import copy
import importlib
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from commfx.models import load_model
from commfx.models.gpt_moe import DecoderLayer, GPTMoE, MoEBlock
from commfx.plan import Plan
from commfx.runtime.launcher import launch
from commfx.verify import probes, split_batch

backend_module = importlib.import_module("commfx.backend")  # `commfx.backend` is the function


def test_backend_is_registered_by_name():
    names = {ep.name for ep in entry_points(group="torch_dynamo_backends")}
    assert "commfx" in names


def test_compiled_model_matches_reference_on_two_ranks():
    sys.path.insert(0, str(Path(__file__).parent))
    world, batch = 2, 5
    results = launch("dist_workers:compiled_with_backend", world, {"batch": batch}, timeout_s=300)
    model, (ids,) = load_model("gpt-moe", dtype=torch.float64, batch=batch)
    ref = model(ids)
    ((ref * probes([ref], batch, 0)[0]).sum() / world).backward()  # mean reduction over ranks
    out = torch.cat([r["output"] for r in results])
    assert (out - ref).abs().max() <= 1e-10
    for name, param in model.named_parameters():
        for r in results:
            assert (r["grads"][name] - param.grad).abs().max() <= 1e-10, name
    # aot_autograd's backward graph holds the backward all-to-alls (2 per MoE layer, 2 layers).
    assert [r["backward_all_to_alls"] for r in results] == [4] * world


@pytest.mark.parametrize("dynamic", [None, False])
def test_new_shapes_recompile_without_collectives_even_on_one_rank(dynamic):
    """A second batch size on rank 0 only, then a new sequence length: dynamo recompiles
    (at step 2 on rank 0 alone), the backend's compiles after the first run no
    collective, and every step's output and gradients equal eager. partition_a2a:k=2 works
    in the backend."""
    sys.path.insert(0, str(Path(__file__).parent))
    world = 2
    results = launch("dist_workers:backend_shapes", world, {"dynamic": dynamic}, timeout_s=300)
    compiles = [len(r["compiles"]) for r in results]
    assert compiles == [3, 2], compiles  # rank 0 alone compiles for its step-2 batch
    for r in results:
        first, *recompiles = r["compiles"]
        assert "all_gather_object" in first  # the token count all ranks agree on
        assert recompiles == [[]] * len(recompiles), recompiles
        assert len(set(r["all_to_alls"])) == 1 and r["all_to_alls"][0] > 0, r["all_to_alls"]  # every graph expert-parallel
    model, _ = load_model("gpt-moe-tiny", dtype=torch.float64)
    for step in zip(*(r["steps"] for r in results)):
        model.zero_grad(set_to_none=True)
        for got in step:
            ref = model(got["ids"])
            assert (got["output"] - ref).abs().max() <= 1e-10
            ((ref * got["probe"]).sum() / world).backward()  # mean reduction over ranks
        for got in step:
            for name, param in model.named_parameters():
                assert (got["grads"][name] - param.grad).abs().max() <= 1e-10, name


class BreakingMoE(MoEBlock):
    """MoEBlock with an optional graph break before its router."""

    def __init__(self, config, breaks: frozenset[str]):
        super().__init__(config)
        self.breaks = breaks

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        x = h.reshape(-1, d)
        _maybe_break(self.breaks, "router")
        weights, indices = self.router(x)
        return self.experts(x, indices, weights).reshape(b, s, d)


class BreakingLayer(DecoderLayer):
    """DecoderLayer with optional graph breaks between attention and MoE, and after the layer."""

    def __init__(self, config, breaks: frozenset[str]):
        super().__init__(config)
        self.breaks = breaks
        self.moe = BreakingMoE(config, breaks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_attn(h))
        _maybe_break(self.breaks, "attention")
        h = h + self.moe(self.ln_moe(h))
        _maybe_break(self.breaks, "layer")
        return h


class BreakingGPT(GPTMoE):
    """GPTMoE whose layers break where `breaks` says, and optionally before the LM head.
    A break inside a layer makes dynamo compile DecoderLayer.forward (and its resume
    functions) once and call the same graphs for every layer, with that layer's weights."""

    def __init__(self, config, breaks: frozenset[str]):
        super().__init__(config)
        self.breaks = breaks
        self.layers = torch.nn.ModuleList(BreakingLayer(config, breaks) for _ in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.ln_f(h)
        _maybe_break(self.breaks, "head")
        return self.lm_head(h)


class UnrolledBreakingGPT(BreakingGPT):
    """BreakingGPT calling its 3 layers one by one. A graph break in a Python loop makes
    dynamo run that whole frame eagerly, so the embeddings and head would reach no graph
    (and no backend's gradient sync); here every weight is in some graph."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.pos(positions)
        first, second, third = self.layers
        return self.head(third(second(first(h))))


def _maybe_break(breaks: frozenset[str], where: str) -> None:
    if where in breaks:
        torch._dynamo.graph_break()


def breaking_model(breaks, *, batch: int, unrolled: bool = False) -> tuple[BreakingGPT, torch.Tensor]:
    """gpt-moe-tiny's weights with 3 layers (float64) in a BreakingGPT, and its batch."""
    model, (ids,) = load_model("gpt-moe-tiny", dtype=torch.float64, batch=batch, num_layers=3)
    broken = (UnrolledBreakingGPT if unrolled else BreakingGPT)(model.config, frozenset(breaks)).to(torch.float64)
    broken.load_state_dict(model.state_dict())
    return broken, ids


# Break placements -> graphs dynamo hands the backend, for (BreakingGPT, UnrolledBreakingGPT).
# Each layer's graphs serve all 3 layers.
BREAKS = {
    ("attention",): (3, 4),
    ("layer",): (2, 3),
    ("router",): (5, 6),
    ("head",): (3, 3),
    ("attention", "router", "head"): (7, 8),
}


def _eager_gradients(model: torch.nn.Module, ids: torch.Tensor, world: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and parameter gradients of `model` on the whole batch, loss as the ranks sum it."""
    model = copy.deepcopy(model)
    out = model(ids)
    ((out * probes([out], ids.shape[0], 0)[0]).sum() / world).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_matches(out, grads, ref_out, ref_grads) -> None:
    assert (out - ref_out).abs().max() <= 1e-10, f"output differs by {(out - ref_out).abs().max():.3g}"
    for name, ref in ref_grads.items():
        assert grads[name] is not None, f"{name} got no gradient"
        assert (grads[name] - ref).abs().max() <= 1e-10, f"{name}: gradient differs by {(grads[name] - ref).abs().max():.3g}"


@pytest.mark.parametrize("breaks", list(BREAKS), ids="+".join)
def test_graph_breaks_in_a_three_layer_model_match_eager(breaks):
    """Graphs that dynamo reuses across layers run each layer's own weights: outputs and
    every gradient equal eager, and the backend got the expected number of graphs."""
    model, ids = breaking_model(breaks, batch=3)
    ref_out, ref_grads = _eager_gradients(model, ids, world=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    be = backend_module.backend(Plan.from_cli("lift,expert_parallel", world_size=1))
    out = torch.compile(model, backend=be)(ids)
    (out * probes([out], ids.shape[0], 0)[0]).sum().backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) >= 1
    assert len(be.programs) == BREAKS[breaks][0]
    _assert_matches(out.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_out, ref_grads)


@pytest.mark.parametrize("passes", ["lift", "lift,expert_parallel"])
def test_graph_breaks_under_the_backend_by_name(monkeypatch, passes):
    """backend="commfx" (passes from COMMFX_PASSES) with a break between attention and MoE."""
    monkeypatch.setenv("COMMFX_PASSES", passes)
    model, ids = breaking_model(("attention",), batch=2)
    ref_out, ref_grads = _eager_gradients(model, ids, world=1)
    torch._dynamo.reset()
    before = len(backend_module._BY_NAME[(passes, 1)].programs) if (passes, 1) in backend_module._BY_NAME else 0
    out = torch.compile(model, backend="commfx")(ids)
    (out * probes([out], ids.shape[0], 0)[0]).sum().backward()
    assert len(backend_module._BY_NAME[(passes, 1)].programs) - before == BREAKS[("attention",)][0]
    _assert_matches(out.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_out, ref_grads)


def graph_breaks_worker(rank: int, world_size: int, cases: list[tuple[tuple[str, ...], bool]], batch: int) -> list[dict]:
    """Each case (breaks, unrolled): a BreakingGPT under the commfx backend with
    expert_parallel on this rank's rows; the second step (graphs compiled) gives the output,
    gradients and all-to-alls."""
    from commfx.runtime.comm import current_scheduler

    results = []
    for breaks, unrolled in cases:
        model, ids = breaking_model(breaks, batch=batch, unrolled=unrolled)
        local = split_batch(ids, world_size, rank)
        probe = split_batch(probes([model(ids)], batch, 0)[0], world_size, rank)
        torch._dynamo.reset()
        be = backend_module.backend(Plan.from_cli("lift,expert_parallel", world_size=world_size), model=model)
        compiled = torch.compile(model, backend=be)
        compiled(local)
        current_scheduler().records = []
        out = compiled(local)
        (out * probe).sum().backward()
        results.append({
            "output": out.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "graphs": len(be.programs),
            "all_to_alls": sum(r.kind == "all_to_all" for r in current_scheduler().records),
            "reduced_eagerly": list(be.eager_sync.reduced),
        })
    return results


def _check_two_ranks(cases: list[tuple[tuple[str, ...], bool]], batch: int = 3) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    world = 2
    results = launch("test_backend:graph_breaks_worker", world, {"cases": cases, "batch": batch}, timeout_s=300)
    for (breaks, unrolled), per_rank in zip(cases, zip(*results)):
        model, ids = breaking_model(breaks, batch=batch, unrolled=unrolled)
        ref_out, ref_grads = _eager_gradients(model, ids, world)
        out = torch.cat([r["output"] for r in per_rank])
        for r in per_rank:
            assert r["graphs"] == BREAKS[breaks][unrolled], breaks
            assert r["all_to_alls"] == 15, breaks  # per layer: counts, dispatch, combine; backward: dispatch, combine
            _assert_matches(out, r["grads"], ref_out, ref_grads)
            if not unrolled and breaks != ("head",):  # the layer loop breaks: dynamo runs the model's own frame eagerly
                assert sorted(r["reduced_eagerly"]) == ["embed.weight", "pos.weight"], r["reduced_eagerly"]


def test_graph_breaks_match_eager_on_two_ranks_with_expert_parallel():
    """Breaks between attention and MoE (graphs reused over layers), inside the layer loop
    (the model's own frame runs eagerly: the backend, given the model, reduces its weights)
    and before the head."""
    _check_two_ranks([(("attention",), True), (("attention",), False), (("head",), False)])


@pytest.mark.slow
def test_graph_breaks_match_eager_on_two_ranks_everywhere():
    _check_two_ranks([(breaks, True) for breaks in BREAKS if breaks != ("attention",)])
