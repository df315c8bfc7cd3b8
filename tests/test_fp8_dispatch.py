"""Low-precision dispatch (issue 31, item 3; DeepEP's recipe): dispatch rows cross as float8
e4m3 bytes with a float32 scale per 128 values; combine and the backward stay bf16."""

import dataclasses
import math

import pytest
import torch

from commfx.compiler.pass_manager import check_plan
from commfx.ops import fp8_dispatch as codec
from commfx.plan import Plan, PlanError
from commfx.runtime.launcher import launch


def _rows(seed: int, rows: int, width: int) -> torch.Tensor:
    """bf16 rows whose magnitudes span twelve decades inside every block, and a zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-6, 6, width)[torch.randperm(width, generator=g)]
    x[0, :128] = 0
    return x.bfloat16()


@pytest.mark.parametrize("width", [16, 128, 200, 384])
def test_the_codec_keeps_its_error_bound(width):
    """|decode(encode(x)) - x| <= (2^-4 + 2^-7)|x| + 2^-10 s per value, s = its block's amax / 448."""
    x = _rows(width, 64, width)
    y = codec.decode(codec.encode(x), width, 0, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    blocks = math.ceil(width / 128)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * 128 - width)).view(64, blocks, 128)
    scale = (padded.abs().amax(2) / 448).repeat_interleave(128, 1)[:, :width]
    error = (y.float() - x.float()).abs()
    assert (error <= (2**-4 + 2**-7) * x.float().abs() + 2**-10 * scale).all()
    assert (error <= 2**-4 * scale * 448 + 2**-10 * scale).all(), "so within 2^-4 of the block's amax"
    assert (y[0, : min(width, 128)] == 0).all(), "a zero block decodes to zeros"
    assert error.max() > 0, "lossy: the bound is not vacuous"


def test_the_payload_is_fp8_bytes_with_exact_metadata_columns():
    x = _rows(1, 8, 128 + 8)
    meta = torch.randn(8, 4)  # float32 routing metadata: 8 bf16 columns, carried bit for bit
    payload = torch.ops.commfx.fp8_encode(x, meta)
    assert payload.dtype == torch.uint8 and payload.shape == (8, 128 + 4 + 16)
    assert codec.payload_width(128, 0, torch.bfloat16) / (2 * 128) == pytest.approx(0.516, abs=1e-3)
    y = codec.decode(payload, 136, codec.exact_columns(torch.bfloat16, meta), torch.bfloat16)
    assert torch.equal(y[:, 128:].view(torch.uint8), x[:, 128:].view(torch.uint8))


def test_fp8_dispatch_is_refused_outside_bf16_and_unknown_codecs_are_named():
    fp32 = Plan.from_cli("lift,expert_parallel:dispatch=fp8", world_size=2)
    with pytest.raises(PlanError, match="dispatch=fp8 quantises bf16 token rows.*add --precision bf16"):
        check_plan(fp32)
    with pytest.raises(PlanError, match="dispatch must be one of rows, fp8, got 'fp4'"):
        check_plan(dataclasses.replace(Plan.from_cli("lift,expert_parallel:dispatch=fp4", world_size=2), precision="bf16"))


def _rows_of(records: list[dict], dtype: str) -> list[dict]:
    return [r for r in records if r["dtype"] == dtype]


def _check_fp8_run(fp8: dict) -> tuple[float, list[dict]]:
    """The fp8 run alone: dispatch as bytes, combine and the whole backward in bf16, the
    scheduler's count equal to the records'. Returns (dispatch bytes / bf16's, dispatch records)."""
    dispatch = _rows_of(fp8["forward"], "torch.uint8")
    assert dispatch and len(_rows_of(fp8["forward"], "torch.bfloat16")) == len(dispatch), "one bf16 combine per fp8 dispatch"
    assert not _rows_of(fp8["backward"], "torch.uint8") and _rows_of(fp8["backward"], "torch.bfloat16")
    assert fp8["a2a_bytes"] == sum(r["bytes"] for r in fp8["forward"] + fp8["backward"]), "the scheduler's count is the records'"
    # the same rows in bf16: a 128-value row (256 bytes, 132 as fp8) and any metadata bytes, exact in both
    low = sum(r["bytes"] for r in dispatch)
    as_bf16 = sum(r["bytes"] // r["width"] * (256 + r["width"] - 132) for r in dispatch)
    return low / as_bf16, dispatch


@pytest.mark.distributed
def test_fp8_dispatch_bytes_from_the_schedulers_count():
    for rank in launch("fp8_workers:dispatch_bytes", 2, {"passes": "lift,expert_parallel", "codecs": ("fp8",)}, timeout_s=180):
        ratio, _ = _check_fp8_run(rank["fp8"])
        assert ratio == pytest.approx(132 / 256), "128 fp8 bytes and one float32 scale for 256 bf16 bytes"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("passes", ["lift,expert_parallel", "lift,expert_parallel,pack_experts,partition_a2a:k=2"])
def test_fp8_dispatch_against_bf16_dispatch(passes):
    """Against a bf16 dispatch run of the same step: the same rows cross, dispatch bytes <= 0.55x
    (exact: the scheduler's counts differ by exactly the dispatch's saving), the combine and
    backward records identical, the loss within 1% and gradients within 10% of their max."""
    for rank in launch("fp8_workers:dispatch_bytes", 2, {"passes": passes}, timeout_s=300):
        bf16, fp8 = rank["rows"], rank["fp8"]
        ratio, dispatch = _check_fp8_run(fp8)
        assert ratio <= 0.55, ratio
        rows = _rows_of(bf16["forward"], "torch.bfloat16")
        bf16_dispatch = [r for r in rows if r not in _rows_of(fp8["forward"], "torch.bfloat16")]
        assert [r["rows"] for r in bf16_dispatch] == [r["rows"] for r in dispatch], "the same rows cross"
        saved = sum(r["bytes"] for r in bf16_dispatch) - sum(r["bytes"] for r in dispatch)
        assert bf16["a2a_bytes"] - fp8["a2a_bytes"] == saved > 0
        assert fp8["backward"] == bf16["backward"], "the backward crosses in bf16, as before"
        assert abs(fp8["loss"] - bf16["loss"]) < 0.01 * abs(bf16["loss"])
        for name, grad in bf16["grads"].items():
            assert (fp8["grads"][name] - grad).abs().max() <= 0.1 * grad.abs().max() + 1e-6, name


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_verify_passes_with_fp8_dispatch():
    """verify's one-process reference quantises the same rows alike (the codec is per row)."""
    from commfx.verify import VerifyCase, verify

    plans = ["lift,expert_parallel:dispatch=fp8", "lift,expert_parallel:dispatch=fp8,pack_experts,partition_a2a:k=2"]
    cases = [VerifyCase("gpt-moe-tiny", dataclasses.replace(Plan.from_cli(p, world_size=2), precision="bf16")) for p in plans]
    for report in verify(cases, 2, timeout_s=300):
        assert report.ok, (report.case.plan.passes, report.failures, report.max_diff)
