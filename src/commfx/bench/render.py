"""`commfx bench`'s tables (rich): timings, bytes, calibration and per-rank compute."""

from __future__ import annotations

from rich.markup import escape

from .results import BenchResult, Timing


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _spread(t: Timing) -> str:
    """Median, and the interquartile range on a second, dim line."""
    return f"{_ms(t.median)}\n[dim]{_ms(t.quantile(0.25))}–{_ms(t.quantile(0.75))}[/dim]"


def _bytes(n: float) -> str:
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"


def _passes_text(passes: str) -> str:
    return escape(passes) if passes else '"" (plain data parallel)'


def timing_table(result: BenchResult):
    from rich.table import Table

    caption = "; ".join(f"{p.label}: {_passes_text(p.passes)}" for p in result.plans)
    table = Table(title=f"{result.model}: ms per step, median and p25–p75 of {result.steps} steps", caption=caption)
    table.add_column("plan")
    for name in ("wall", "compute-only", "comm-only", "max(comp, comm)", "wall ÷ max"):
        table.add_column(name, justify="right")
    for p in result.plans:
        table.add_row(p.label, _spread(p.wall), _spread(p.compute), _spread(p.comm), _ms(p.bound),
                      f"{p.wall.median / p.bound:.2f}")
    base = result.baseline
    if base is not None:
        for p in result.plans:
            if p is base:
                continue
            table.add_row(f"{p.label} ÷ baseline", f"{p.wall.median / base.wall.median:.2f}",
                          f"{p.compute.median / base.compute.median:.2f}", f"{p.comm.median / base.comm.median:.2f}",
                          f"{p.bound / base.bound:.2f}", f"{p.wall.median / base.bound:.2f} of baseline's", style="bold")
    return table


def bytes_table(result: BenchResult):
    from rich.table import Table

    table = Table(title="bytes per step, all ranks (exact counts from the comm scheduler)")
    for name, justify in (("plan", "left"), ("collective", "left"), ("calls", "right"),
                          ("intra-node B", "right"), ("inter-node B", "right")):
        table.add_column(name, justify=justify)
    for p in result.plans:
        for kind, entry in p.bytes.items():
            table.add_row(p.label, kind, _bytes(entry["calls"]), _bytes(entry["intra_node_bytes"]),
                          _bytes(entry["inter_node_bytes"]))
        table.add_row(p.label, "total", "", _bytes(p.total("intra_node_bytes")), _bytes(p.total("inter_node_bytes")),
                      style="bold", end_section=True)
    return table


def calibration_table(calibration: dict):
    from rich.table import Table

    table = Table(title="calibration", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("compute (float32 matmul, whole machine)", f"{calibration['machine_flops'] / 1e9:.1f} GFLOP/s")
    table.add_row("compute per rank (ranks share the cores)", f"{calibration['per_rank_flops'] / 1e9:.2f} GFLOP/s")
    for where in ("inter", "intra"):
        probe = calibration["link"].get(where)
        if probe:
            table.add_row(f"{where}-node link, ranks {tuple(probe['ranks'])}",
                          f"{probe['throughput_bits'] / 1e6:,.0f} Mbit/s, rtt {probe['rtt_s'] * 1e3:.2f} ms")
    lo, hi = calibration["gpu_flops_per_byte_range"]
    for key, label in (("flops_per_byte_at_set_rate", "FLOPs per inter-node byte at the set rate"),
                       ("flops_per_byte_at_measured_rate", "FLOPs per inter-node byte at the measured rate")):
        if key in calibration:
            value = calibration[key]
            verdict = "GPU-like" if lo <= value <= hi else ("comm cheaper than on GPUs" if value < lo else "comm dearer than on GPUs")
            table.add_row(label, f"{value:,.0f}: {verdict} (GPU clusters {lo:g}–{hi:g})")
    for target, rate in calibration["rate_for_flops_per_byte"].items():
        table.add_row(f"link rate giving {float(target):g} FLOPs/byte", rate)
    return table


def straggler_table(result: BenchResult):
    """Every rank's own compute per plan: where the straggler is, and what resize_tp did."""
    from rich.table import Table

    table = Table(title=f"per-rank compute, ms (median): {escape(result.straggler['describe'])}")
    table.add_column("plan")
    table.add_column("straggler")
    for kind in ("compute-only step", "training step less comm waits"):
        table.add_column(kind, justify="right")
    for p in result.plans:
        table.add_row(p.label, "slow" if p.slowed else "healthy",
                      " / ".join(_ms(t.median) for t in p.rank_compute), " / ".join(_ms(t.median) for t in p.rank_own_compute))
    return table


def render(result: BenchResult, console) -> None:
    """Print the tables and the paired ratio (what the interleaving buys)."""
    console.print(timing_table(result))
    console.print(bytes_table(result))
    if result.straggler is not None:
        console.print(straggler_table(result))
        for p in result.plans:
            for line in p.decisions:
                console.print(f"{p.label}: resize_tp {line}", markup=False)
    for p in result.plans:
        for line in p.placement_decisions:
            console.print(f"{p.label}: pack_experts re-placed {line}", markup=False)
    if result.paired_wall_ratio is not None:
        r = result.paired_wall_ratio
        console.print(
            f"paired wall ratio plan ÷ baseline (same round, interleaved): median {r.median:.2f}, "
            f"p25–p75 {r.quantile(0.25):.2f}–{r.quantile(0.75):.2f}, min–max {min(r.samples):.2f}–{max(r.samples):.2f}"
        )
    if not result.emulated:
        console.print(f"[yellow]not emulated:[/yellow] {escape(result.fallback_reason)}")
