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


def _maybe(value: float | None, fmt) -> str:
    return "–" if value is None else fmt(value)


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}"


def timing_table(result: BenchResult):
    from rich.table import Table

    caption = "; ".join(f"{p.label}: {_passes_text(p.passes)}" for p in result.plans)
    caption += ("\nreplay bound = max(compute-only, comm-only replay): a diagnostic. wire bound = max(compute-only, "
                "busiest link's wire bytes ÷ link rate + messages × latency): the floor; – where no link was counted")
    table = Table(title=f"{result.model}: ms per step, median and p25–p75 of {result.steps} steps", caption=caption)
    table.add_column("plan")
    for name in ("wall", "compute-only", "comm-only", "replay bound", "wire bound", "wall ÷ wire bound"):
        table.add_column(name, justify="right")
    for p in result.plans:
        table.add_row(p.label, _spread(p.wall), _spread(p.compute), _spread(p.comm), _ms(p.replay_bound),
                      _maybe(p.wire_bound, _ms), _ratio(p.wall.median, p.wire_bound))
    base = result.baseline
    if base is not None:
        for p in result.plans:
            if p is base:
                continue
            table.add_row(f"{p.label} ÷ baseline", f"{p.wall.median / base.wall.median:.2f}",
                          f"{p.compute.median / base.compute.median:.2f}", f"{p.comm.median / base.comm.median:.2f}",
                          f"{p.replay_bound / base.replay_bound:.2f}", _ratio(p.wire_bound, base.wire_bound),
                          f"{_ratio(p.wall.median, base.wire_bound)} of baseline's", style="bold")
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
        for kind, nbytes in p.peer_bytes.items():  # a peer's own count: payload handed in, the rank's own share too
            table.add_row(p.label, f"{kind} (peer's payload)", "", "", _bytes(nbytes))
        table.add_row(p.label, "total", "", _bytes(p.total("intra_node_bytes")), _bytes(p.total("inter_node_bytes")),
                      style="bold", end_section=True)
    return table


def wire_table(result: BenchResult):
    """Bytes per step the links' own counters saw, beside the scheduler's inter-node count;
    a gap past the tolerance is flagged, not hidden."""
    from rich.table import Table

    from .wire import AGREEMENT_TOLERANCE

    table = Table(title="bytes on the wire per step (link counters of each node's veth) vs the scheduler's count",
                  caption=f"wire ÷ scheduler should be within ±{AGREEMENT_TOLERANCE:.0%} "
                          "(Ethernet/IP/TCP headers, acknowledgements, gloo framing); ✗ marks a larger gap")
    names = ["plan", *(f"node {n['node']} tx / rx B" for n in result.plans[0].wire_per_node()),
             "busiest link B", "wire sent B", "scheduler inter-node B", "wire ÷ scheduler", "messages"]
    for name in names:
        table.add_column(name, justify="left" if name == "plan" else "right")
    for p in result.plans:
        nodes = p.wire_per_node()
        ratio = p.wire_over_scheduler
        verdict = "–" if ratio is None else f"{ratio:.3f} ✓" if p.wire_agrees else f"[bold red]{ratio:.3f} ✗[/bold red]"
        table.add_row(p.label, *(f"{_bytes(round(n['tx_bytes']))} / {_bytes(round(n['rx_bytes']))}" for n in nodes),
                      _bytes(round(p.busiest_link_bytes)), _bytes(round(p.wire_sent_bytes)),
                      _bytes(p.total("inter_node_bytes")), verdict, f"{p.messages:g}")
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
    if result.batches is not None:
        b = result.batches
        console.print(f"batches: {b['source']}; {b['distinct_measured']} different in the measured steps"
                      + ("" if b["same_for_every_plan"] else "; NOT the same for every plan"), markup=False)
    for p in result.plans:
        if p.peer_check:
            console.print(f"{p.label}: {p.peer_check}", markup=False)
    console.print(bytes_table(result))
    if all(p.wire is not None for p in result.plans):
        console.print(wire_table(result))
    else:
        console.print("bytes on the wire: not counted (no inter-node link: one node, or plain localhost)", markup=False)
    if result.straggler is not None:
        console.print(straggler_table(result))
        for p in result.plans:
            for line in p.decisions:
                console.print(f"{p.label}: resize_tp {line}", markup=False)
    for p in result.plans:
        for line in p.placement_decisions:
            console.print(f"{p.label}: pack_experts re-placed {line}", markup=False)
        for line in p.choices:
            console.print(f"{p.label}: {line}", markup=False)
    passes = {p.label: p.passes for p in result.plans}
    for label, r in result.paired_wall_ratios.items():
        console.print(
            f"paired wall ratio plan ÷ {label} ({_passes_text(passes[label])}; same round, interleaved): median {r.median:.2f}, "
            f"p25–p75 {r.quantile(0.25):.2f}–{r.quantile(0.75):.2f}, min–max {min(r.samples):.2f}–{max(r.samples):.2f}"
        )
    if not result.emulated:
        console.print(f"[yellow]not emulated:[/yellow] {escape(result.fallback_reason)}")
