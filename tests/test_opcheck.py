"""`torch.library.opcheck` on every op in the `commfx` namespace.

Each op has a sample here (float64, small); the first test fails when an op is registered
without one, so a new op cannot skip these checks. Communication ops run on a world of one
under a local comm scheduler. Where a check cannot apply, the sample leaves it out and says
why in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import commfx.api  # noqa: F401  (everything that registers ops)
import commfx.ops  # noqa: F401
from commfx.ops import locality
from commfx.runtime.comm import active, local_scheduler

ops = torch.ops.commfx
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

# Why a check is left out, by kind of op.
BACKWARD_OP = "a backward formula, never differentiated itself (no double backward): no autograd to check"
NO_FLOAT_INPUT = "integer or bool inputs only: nothing to differentiate"
NOT_DIFFERENTIABLE = "not differentiable (returns a measurement, indices or a mask)"
LOWERED_ONLY = "exists only in lowered graphs (after aot_autograd): no fake implementation or autograd by design"
WAIT = LOWERED_ONLY + "; returns its input object, the buffer the collective fills (as torch's _c10d_functional.wait_tensor), which test_schema forbids below autograd"


@dataclass(frozen=True)
class Sample:
    args: Callable[[], tuple]
    skip: tuple[str, ...] = ()
    why: str = ""


def f64(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


N, K, E, H, I = 6, 2, 4, 3, 5  # tokens, top-k, experts, hidden, expert hidden
INDICES = [[0, 1], [0, 2], [0, 3], [1, 2], [3, 1], [2, 0]]
COUNTS = [4, 3, 3, 2]  # rows per expert of INDICES
LOCAL_IDS = [[0, -1], [1, 0], [-1, -1], [2, 1], [0, 2]]  # 5 received rows, 3 local experts
IDS = [[1, 4, 4, 7], [0, 9, 1, 2]]
UNIQUE_IDS = [0, 1, 2, 4, 7, 9]  # IDS's rows, each once (a row-sharded table's owner on a world of one)
INVERSE = [[1, 3, 3, 4], [0, 5, 1, 2]]  # where each of IDS sits in UNIQUE_IDS


def _meta():
    """rank_dispatch metadata [U, 2k]: routing weights, then local ids as floats (-1: elsewhere)."""
    weights = torch.rand(5, K, dtype=torch.float64)
    ids = torch.tensor(LOCAL_IDS, dtype=torch.float64)
    return torch.cat([weights * (ids >= 0), ids], dim=1)


def _vocab_forward():
    x, weight, labels = f64(5, H, grad=False), f64(7, H, grad=False), i64([1, 6, -100, 3, 0])
    return x, weight, labels, ops.vocab_parallel_loss(x, weight, labels, -100, "mean", "world", 1, "a2a")


def _vocab_backward_args():
    x, weight, labels, (loss, x_all, labels_all, logits, lse, counts) = _vocab_forward()
    return (torch.ones((), dtype=torch.float64), x, x_all, weight, labels_all, logits, lse, counts, -100, "mean", "world", 1, "a2a")


SAMPLES: dict[str, Sample] = {
    # ------------------------------------------------------------------ moe
    "topk_router": Sample(lambda: (f64(N, E), K, True, torch.float64)),
    "moe_dispatch": Sample(lambda: (f64(N, H), i64(INDICES), E, 0.0)),
    "moe_scatter_rows": Sample(
        lambda: (f64(N * K, H, grad=False), torch.randperm(N * K), N, K), ("test_autograd_registration",), BACKWARD_OP
    ),
    "moe_combine": Sample(lambda: (f64(N * K, H), i64([0, 4, 1, 7, 2, -1, 5, 8, 10, 6, 9, 3]), f64(N, K))),
    "moe_combine_backward": Sample(
        lambda: (f64(N, H, grad=False), f64(N * K, H, grad=False), i64([0, 4, 1, 7, 2, -1, 5, 8, 10, 6, 9, 3]), f64(N, K, grad=False)),
        ("test_autograd_registration",), BACKWARD_OP,
    ),
    "expert_ffn": Sample(lambda: (f64(12, H), i64(COUNTS), f64(E, 2 * I, H), f64(E, H, I), "silu")),
    "expert_ffn_backward": Sample(
        lambda: (f64(12, H, grad=False), f64(12, H, grad=False), i64(COUNTS), f64(E, 2 * I, H, grad=False), f64(E, H, I, grad=False), "silu"),
        ("test_autograd_registration",), BACKWARD_OP,
    ),
    "grouped_mm": Sample(lambda: (f64(12, H), f64(E, I, H), i64(COUNTS), True)),
    "grouped_mm_weight_grad": Sample(
        lambda: (f64(12, I, grad=False), f64(12, H, grad=False), i64(COUNTS)), ("test_autograd_registration",), BACKWARD_OP
    ),
    "group_by_expert": Sample(lambda: (f64(9, H), i64([[1, 0, 2], [3, 2, 1]]), False)),
    # ------------------------------------------------------------------ packed experts
    "expert_slots": Sample(lambda: (i64(INDICES), None, "opcheck", E, 1), ("test_autograd_registration",), NO_FLOAT_INPUT),
    "rank_dispatch": Sample(lambda: (f64(N, H), i64(INDICES), f64(N, K), 2, 2, 0.0)),
    "rank_dispatch_backward": Sample(
        lambda: (f64(5, H, grad=False), f64(5, 2 * K, grad=False), i64([0, 1, 3, 3, 5]), _meta(), N),
        ("test_autograd_registration",), BACKWARD_OP,
    ),
    "scatter_add_tokens": Sample(lambda: (f64(5, H), i64([0, 1, 3, 3, 5]), torch.empty(N, 0))),
    "attach_meta": Sample(lambda: (f64(5, H), f64(5, 2 * K))),
    "detach_meta": Sample(lambda: (ops.attach_meta(f64(5, H, grad=False), _meta()).requires_grad_(), _meta())),
    "masked_dispatch": Sample(lambda: (f64(5, H), i64(LOCAL_IDS), 3)),
    "packed_expert_ffn": Sample(lambda: (f64(5, H), i64(LOCAL_IDS), f64(5, K), f64(3, 2 * I, H), f64(3, H, I), "silu")),
    "packed_expert_ffn_backward": Sample(
        lambda: (f64(5, H, grad=False), f64(5, H, grad=False), i64(LOCAL_IDS), f64(5, K, grad=False), f64(3, 2 * I, H, grad=False), f64(3, H, I, grad=False), "silu"),
        ("test_autograd_registration",), BACKWARD_OP,
    ),
    # ------------------------------------------------------------------ chunks
    "chunk_counts": Sample(lambda: (i64([[3, 0, 5, 2]]), 2), ("test_autograd_registration",), NO_FLOAT_INPUT),
    "split_chunks": Sample(lambda: (f64(10, H), i64([3, 0, 5, 2]), 2)),
    "merge_chunks": Sample(lambda: ([f64(4, H, seed=1), f64(6, H, seed=2)], i64([3, 0, 5, 2]), 2)),
    # ------------------------------------------------------------------ communication (world of one)
    "all_to_all": Sample(lambda: (f64(N, H), i64([[2, 4]]), i64([[2, 4]]), "ep", "a2a", "opcheck")),
    "fp8_encode": Sample(lambda: (f64(N, H, grad=False), None), ("test_autograd_registration",), "returns bytes (uint8): " + NOT_DIFFERENTIABLE),
    "fp8_decode": Sample(
        lambda: (ops.fp8_encode(f64(5, H + 2 * K, grad=False), _meta()), f64(5, H + 2 * K), i64([[2, 3]]), i64([[2, 3]]), "ep", "a2a", "opcheck", _meta())
    ),
    "all_to_all_start": Sample(
        lambda: (f64(N, H, grad=False), i64([[2, 4]]), i64([[2, 4]]), "ep", "a2a", "opcheck"),
        ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"), LOWERED_ONLY,
    ),
    "wait_tensor": Sample(lambda: (f64(N, H, grad=False),), ALL_UTILS, WAIT),
    "exchange_counts": Sample(lambda: (i64(COUNTS), "ep", 1, "a2a"), ("test_autograd_registration",), NO_FLOAT_INPUT),
    "local_shard": Sample(lambda: (f64(E, H), "ep", 1)),
    "local_shard_backward": Sample(lambda: (f64(E, H, grad=False), E, "ep"), ("test_autograd_registration",), BACKWARD_OP),
    "all_reduce": Sample(lambda: (f64(N, H), "tp", "opcheck")),
    "tp_copy": Sample(lambda: (f64(N, H), "tp")),
    "tp_linear": Sample(lambda: (f64(2, N, H), f64(I, H), f64(I), "opcheck", "tp")),
    "tp_linear_backward": Sample(
        lambda: (f64(2, N, I, grad=False), f64(2, N, H, grad=False), f64(I, H, grad=False), True, "opcheck", "tp"),
        ("test_autograd_registration",), BACKWARD_OP,
    ),
    "tp_units": Sample(lambda: (f64(N, H), [f64(N, H, seed=1), i64([1, 2])], [4], "opcheck", "tp")),
    "tp_units_backward": Sample(
        lambda: (f64(N, H, grad=False), [f64(N, H, grad=False, seed=1)], "opcheck", "tp"), ("test_autograd_registration",), BACKWARD_OP
    ),
    # ------------------------------------------------------------------ locality gate
    "home_experts": Sample(lambda: (f64(N, H, grad=False), [0, 0, 1, 1], [0], "world"), ("test_autograd_registration",), NOT_DIFFERENTIABLE),
    "locality_topk": Sample(
        lambda: (f64(N, E, grad=False), torch.tensor([True, True, False, False]), K, [0, 0, 1, 1], 1, 0.5, 0.0),
        ("test_autograd_registration",), NOT_DIFFERENTIABLE,
    ),
    "add_aux_loss": Sample(lambda: (f64(N, H), f64(2), "opcheck")),
    "measure_capacity_floor": Sample(
        lambda: (f64(N, H, grad=False), f64(E, H, grad=False), i64(INDICES), E, 1.0, "opcheck"), ("test_autograd_registration",), NOT_DIFFERENTIABLE
    ),
    # ------------------------------------------------------------------ embeddings
    "embedding": Sample(lambda: (f64(10, H), i64(IDS), 4)),
    "embedding_dense_grad": Sample(lambda: (f64(2, 4, H, grad=False), i64(IDS), 10, 4), ("test_autograd_registration",), BACKWARD_OP),
    "sparse_grad_embedding": Sample(lambda: (f64(10, H), i64(IDS), -1, "world", 1, 0.5, "a2a")),
    "exchange_row_grads": Sample(
        lambda: (f64(2, 4, H, grad=False), i64(IDS), 10, -1, "world", 1, 0.5, "a2a"), ("test_autograd_registration",), BACKWARD_OP
    ),
    "embedding_route": Sample(lambda: (i64(IDS), 10, 1), ("test_autograd_registration",), NO_FLOAT_INPUT),
    "embedding_counts": Sample(lambda: (i64([5]), "world", "a2a"), ("test_autograd_registration",), NO_FLOAT_INPUT),
    "embedding_all_to_all": Sample(lambda: (f64(5, H), i64([5]), i64([5]), "world", "a2a", "opcheck")),
    "local_rows": Sample(lambda: (i64(IDS), 10, "world"), ("test_autograd_registration",), NO_FLOAT_INPUT),
    "mask_padding_grad": Sample(lambda: (f64(2, 4, H), i64(IDS), 4)),
    "row_embedding": Sample(lambda: (f64(10, H), i64(IDS), -1, "opcheck", "world", 1, 0.5)),
    "row_sharded_embedding": Sample(
        lambda: (f64(10, H), i64(UNIQUE_IDS), i64(INVERSE), i64(IDS), i64([len(UNIQUE_IDS)]), i64([len(UNIQUE_IDS)]), -1, "opcheck", "world", 1, 0.5)
    ),
    "post_row_grads": Sample(
        lambda: (f64(2, 4, H, grad=False), i64(IDS), 10, -1, "opcheck", "sparse", "world", 1, 0.5), ("test_autograd_registration",), BACKWARD_OP
    ),
    # ------------------------------------------------------------------ vocabulary-parallel head
    "vocab_parallel_loss": Sample(lambda: (f64(5, H), f64(7, H), i64([1, 6, -100, 3, 0]), -100, "mean", "world", 1, "a2a")),
    "vocab_parallel_loss_backward": Sample(_vocab_backward_args, ("test_autograd_registration",), BACKWARD_OP),
}


# More samples of ops whose behaviour changes with an argument ("op:variant").
VARIANTS: dict[str, Sample] = {
    "grouped_mm:no_trans": Sample(lambda: (f64(12, H), f64(E, H, I), i64(COUNTS), False)),
    "moe_dispatch:capacity": Sample(lambda: (f64(N, H), i64(INDICES), E, 0.75, torch.tensor(0.5, dtype=torch.float64))),
    "rank_dispatch:capacity": Sample(lambda: (f64(N, H), i64(INDICES), f64(N, K), 2, 2, 0.75)),
    "topk_router:unnormalised": Sample(lambda: (f64(N, E), K, False, torch.float32)),
}


def registered_ops() -> set[str]:
    """Names of every op in the commfx namespace, however it was declared."""
    return {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("commfx::")}


def test_every_commfx_op_has_a_sample():
    """A new op must come with a sample here (and so with opcheck)."""
    registered = registered_ops()
    assert not registered - set(SAMPLES), f"commfx ops without an opcheck sample in tests/test_opcheck.py: {sorted(registered - set(SAMPLES))}"
    assert not set(SAMPLES) - registered, f"samples for ops that are not registered: {sorted(set(SAMPLES) - registered)}"
    for name in registered:
        assert getattr(ops, name).overloads() == ["default"], f"commfx.{name} has overloads {getattr(ops, name).overloads()}: sample each"
    assert {v.split(":")[0] for v in VARIANTS} <= set(SAMPLES), "a variant names an op with no sample"
    for name, sample in (SAMPLES | VARIANTS).items():
        assert bool(sample.skip) == bool(sample.why), f"{name}: a check left out needs its reason (and a reason needs a check left out)"
        assert set(sample.skip) <= set(ALL_UTILS), f"{name}: unknown checks {set(sample.skip) - set(ALL_UTILS)}"


@pytest.fixture
def reports_untouched():
    """Ops that record what they measured for `commfx run`'s report: leave no opcheck entries."""
    saved = dict(locality.LAST_AUX_LOSSES), dict(locality.LAST_CAPACITY)
    yield
    for live, before in zip((locality.LAST_AUX_LOSSES, locality.LAST_CAPACITY), saved):
        live.clear()
        live.update(before)


@pytest.mark.parametrize("name", sorted(SAMPLES | VARIANTS))
def test_opcheck(name, reports_untouched):
    sample = (SAMPLES | VARIANTS)[name]
    utils = tuple(u for u in ALL_UTILS if u not in sample.skip)
    op = getattr(ops, name.split(":")[0]).default
    with active(local_scheduler()):
        args = sample.args()
        if utils:
            torch.library.opcheck(op, args, test_utils=utils)
        else:  # nothing opcheck can check: the op still runs
            op(*args)
