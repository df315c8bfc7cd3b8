"""Bytes on the wire and the wire bound (commfx.bench.wire, the bench's results and tables),
from known numbers: no namespaces, no ranks (tests/test_cluster.py reads real link counters,
tests/test_bench.py checks them against the scheduler in a 2-node bench run)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from commfx.bench.links import LinkSpec
from commfx.bench.render import render, timing_table, wire_table
from commfx.bench.results import BenchResult, PlanResult, Timing, _wire_per_node
from commfx.bench.wire import AGREEMENT_TOLERANCE, LinkCounters, parse_net_dev, read_counters, wire_bound

NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1200      10    0    0    0     0          0         0     1200      10    0    0    0     0       0          0
cfx7n0:123456789   4321    0    0    0     0          0         0 987654321    8765    0    0    0     0       0          0
"""


def test_parse_net_dev_reads_bytes_and_packets_per_device():
    devices = parse_net_dev(NET_DEV)
    assert devices["lo"] == LinkCounters(rx_bytes=1200, tx_bytes=1200, rx_packets=10, tx_packets=10)
    # the name's colon touches the first number once the number is wide
    assert devices["cfx7n0"] == LinkCounters(rx_bytes=123456789, tx_bytes=987654321, rx_packets=4321, tx_packets=8765)
    assert devices["cfx7n0"] - devices["lo"] == LinkCounters(123455589, 987653121, 4311, 8755)
    with pytest.raises(ValueError, match="unexpected line"):
        parse_net_dev(NET_DEV + "broken line\n")


def test_read_counters_names_a_missing_device(tmp_path):
    path = tmp_path / "dev"
    path.write_text(NET_DEV)
    assert read_counters("cfx7n0", str(path)).tx_bytes == 987654321
    with pytest.raises(ValueError, match=r"no device 'eth9'.*cfx7n0, lo"):
        read_counters("eth9", str(path))
    assert read_counters("lo").rx_bytes >= 0  # this process's own namespace


def test_wire_bound_from_known_numbers():
    # 2.5 MB on the busiest link at 100 Mbit/s is 0.2 s; 10 messages at 1 ms add 10 ms
    assert wire_bound(0.1, 2.5e6, 100e6, messages=10, latency_s=1e-3) == pytest.approx(0.21)
    assert wire_bound(0.3, 2.5e6, 100e6, messages=10, latency_s=1e-3) == 0.3  # compute-bound
    assert wire_bound(0.0, 2.5e6, 100e6) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="positive"):
        wire_bound(0.1, 1.0, 0.0)


def _plan(label: str, wire: list[dict] | None, inter_node_bytes: float, link: LinkSpec | None = LinkSpec("100mbit", "1ms"),
          compute: float = 0.1, comm: float = 0.5, messages: float = 10) -> PlanResult:
    return PlanResult(
        label, "lift,expert_parallel", wall=Timing([0.4, 0.5, 0.6]), compute=Timing([compute] * 3), comm=Timing([comm] * 3),
        bytes={"all_to_all": {"calls": 4, "intra_node_bytes": 0, "inter_node_bytes": inter_node_bytes}},
        wire=wire, messages=messages, link=link,
    )


# per node, two rounds of (tx, rx) bytes per step: node 1's link is the busiest (2.5 MB received)
WIRE = [{"node": 0, "device": "cfx7n0", "samples": [(2.0e6, 2.4e6), (2.2e6, 2.6e6)]},
        {"node": 1, "device": "cfx7n1", "samples": [(2.4e6, 2.0e6), (2.6e6, 2.2e6)]}]


def test_plan_result_wire_figures_and_bound():
    p = _plan("plan", WIRE, inter_node_bytes=4.5e6)
    assert p.wire_per_node() == [{"node": 0, "device": "cfx7n0", "tx_bytes": 2.1e6, "rx_bytes": 2.5e6},
                                 {"node": 1, "device": "cfx7n1", "tx_bytes": 2.5e6, "rx_bytes": 2.1e6}]
    assert p.busiest_link_bytes == 2.5e6 and p.wire_sent_bytes == pytest.approx(4.6e6)
    assert p.wire_over_scheduler == pytest.approx(4.6 / 4.5) and p.wire_agrees is True
    assert p.wire_bound == pytest.approx(0.21)  # 2.5 MB at 100 Mbit/s + 10 x 1 ms, above compute 0.1 s
    assert p.replay_bound == 0.5  # max(compute, comm replay): above the wire bound, so no floor
    off = _plan("plan", WIRE, inter_node_bytes=4.6e6 / (1 + AGREEMENT_TOLERANCE) * 0.99)
    assert off.wire_agrees is False
    assert _plan("plan", WIRE, 4.5e6, link=None).wire_bound is None  # --inter-node none: no rate to divide by
    local = _plan("plan", None, 4.5e6)
    assert (local.wire_per_node(), local.busiest_link_bytes, local.wire_over_scheduler, local.wire_bound) == (None,) * 4


def test_wire_per_node_takes_each_nodes_first_rank():
    ranks = [{"wire_device": "cfx7n0", "wire": [[1.0, 2.0]]}, {"wire_device": None, "wire": [None]},
             {"wire_device": "cfx7n1", "wire": [[3.0, 4.0]]}, {"wire_device": None, "wire": [None]}]
    assert _wire_per_node(ranks, ranks_per_node=2) == [{"node": 0, "device": "cfx7n0", "samples": [(1.0, 2.0)]},
                                                       {"node": 1, "device": "cfx7n1", "samples": [(3.0, 4.0)]}]
    assert _wire_per_node([{"wire_device": None, "wire": [None]}] * 2, ranks_per_node=1) is None


def _result(plans: list[PlanResult], link: str | None = "100mbit,1ms") -> BenchResult:
    return BenchResult(model="gpt-moe", model_kwargs={}, nodes=2, ranks_per_node=1, link=link, emulated=True,
                       cluster="2 nodes", fallback_reason="", steps=3, warmup=1, plans=plans)


def test_json_has_both_bounds_and_wire_bytes_and_headlines_quote_the_wire_bound():
    plan = _plan("plan", WIRE, inter_node_bytes=4.5e6)
    base = _plan("baseline", [{**n, "samples": [(2 * tx, 2 * rx) for tx, rx in n["samples"]]} for n in WIRE],
                 inter_node_bytes=9.0e6, comm=1.0)
    out = json.loads(json.dumps(_result([plan, base]).as_dict()))
    assert (out["inter_node_rate_bits"], out["inter_node_latency_s"]) == (100e6, 1e-3) and out["wire_counters"]
    p = out["plans"][0]
    assert "overlap_bound_s" not in p
    assert p["replay_bound_s"] == 0.5 and p["wire_bound_s"] == pytest.approx(0.21) and p["wire_messages_per_step"] == 10
    wire = p["wire_bytes_per_step"]
    assert wire["busiest_link_bytes"] == 2.5e6 and wire["sent_bytes"] == pytest.approx(4.6e6)
    assert wire["scheduler_inter_node_bytes"] == 4.5e6 and wire["agrees"] is True and wire["agrees_within"] == 0.1
    assert [n["tx_bytes"] for n in wire["per_node"]] == [2.1e6, 2.5e6]
    assert wire["samples"][1]["tx_rx_bytes"] == [[2.4e6, 2.0e6], [2.6e6, 2.2e6]]
    base_bound = 5.0e6 * 8 / 100e6 + 10e-3  # 0.41 s
    assert out["plans"][1]["wire_bound_s"] == pytest.approx(base_bound)
    ratios = out["ratios_plan_over_baseline"]
    assert ratios["wire_bound"] == pytest.approx(0.21 / base_bound) and ratios["replay_bound"] == 0.5
    assert ratios["busiest_link_wire_bytes"] == 0.5
    headline = out["wall_over_baseline"]["plan"]
    assert headline["wall_over_own_wire_bound"] == pytest.approx(0.5 / 0.21)
    assert headline["wall_over_baseline_wire_bound"] == pytest.approx(0.5 / base_bound)
    assert headline["wall_over_own_replay_bound"] == 1.0


def test_json_says_null_without_a_link():
    out = json.loads(json.dumps(_result([_plan("plan", None, 4.5e6), _plan("baseline", None, 9e6)]).as_dict()))
    p = out["plans"][0]
    assert p["wire_bytes_per_step"] is None and p["wire_bound_s"] is None and out["wire_counters"] is None
    assert out["ratios_plan_over_baseline"]["wire_bound"] is None
    assert out["wall_over_baseline"]["plan"]["wall_over_own_wire_bound"] is None


def _text(table_or_result) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    if isinstance(table_or_result, BenchResult):
        render(table_or_result, console)
    else:
        console.print(table_or_result)
    return console.file.getvalue()


def test_tables_show_both_bounds_and_flag_a_wire_gap():
    good = _plan("plan", WIRE, inter_node_bytes=4.5e6)
    gap = _plan("baseline", WIRE, inter_node_bytes=3.0e6)  # the wire carried 53% more than counted
    text = _text(wire_table(_result([good, gap])))
    assert "1.022 ✓" in text and "1.533 ✗" in text
    assert "2,100,000 / 2,500,000" in text and "4,600,000" in text
    timing = _text(timing_table(_result([good, gap])))
    for column in ("replay bound", "wire bound", "wall ÷ wire bound"):
        assert column in timing
    assert "210.0" in timing and "2.38" in timing  # the wire bound, and wall 0.5 s ÷ 0.21 s
    local = _result([_plan("plan", None, 4.5e6), _plan("baseline", None, 9e6)], link=None)
    text = _text(local)
    assert "bytes on the wire: not counted" in text and "wire ÷ scheduler" not in text
