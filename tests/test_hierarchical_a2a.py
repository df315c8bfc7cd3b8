"""Hierarchical all-to-all (DeepEP forwarding, Tutel 2DH): bit for bit the flat all-to-all,
one message per remote node on the link, none between ranks with nothing to exchange."""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from commfx.compiler.pass_manager import check_plan
from commfx.plan import Plan, PlanError
from commfx.runtime.hierarchical_a2a import NodeLayout, decode_inter, encode_inter, hierarchical_all_to_all, unique_rows
from commfx.verify import VerifyCase, verify

BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BIT_VIEWS[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_forwarders_pair_ranks_of_the_same_local_index():
    layout = NodeLayout((0, 0, 1, 1))
    assert [layout.forwarder(s, 1) for s in (0, 1)] == [2, 3]
    assert [layout.deliverer(s, 3) for s in range(4)] == [2, 3, 2, 3]  # rank 0 via its rail peer 2; same node: the source itself
    assert layout.forwarded_by(2) == [0] and layout.forwarded_by(1) == [3]
    uneven = NodeLayout((0, 0, 0, 1))
    assert [uneven.forwarder(s, 1) for s in (0, 1, 2)] == [3, 3, 3]
    assert uneven.forwarded_by(3) == [0, 1, 2] and uneven.forwarded_by(0) == [3] and uneven.forwarded_by(1) == []


def test_unique_rows_compare_bits():
    rows = torch.tensor([[0.0, 1.0], [-0.0, 1.0], [0.0, 1.0], [float("nan"), 1.0], [float("nan"), 1.0]])
    unique, index = unique_rows(rows)
    assert unique.shape[0] == 3  # 0.0 and -0.0 stay apart, the two NaN rows merge
    assert torch.equal(unique[index.long()].view(torch.int32), rows.view(torch.int32))


def test_unique_rows_never_merge_rows_that_share_the_hashed_words():
    """Rows equal in their first words and different later: the full comparison keeps them apart."""
    rows = torch.zeros(6, 40, dtype=torch.float64)
    rows[1, 39] = 1.0
    rows[3, 20] = -0.0
    rows[4] = rows[1]
    unique, index = unique_rows(rows)
    assert unique.shape[0] == 3
    assert torch.equal(_bits(unique[index.long()]), _bits(rows))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_inter_node_message_round_trips_and_is_never_longer_than_the_rows(dtype):
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(5, 3, 4, generator=g) * 4).to(dtype)
    for rows in (base, base[[0, 1, 0, 2, 1, 0, 4]], base[:0]):
        message = encode_inter(rows, short_receives=True)
        assert message.numel() <= 8 + rows.numel() * rows.element_size()
        buf = torch.full((8 + rows.numel() * rows.element_size() + 16,), 7, dtype=torch.uint8)  # longer than the message
        buf[: message.numel()] = message
        assert _same_bits(decode_inter(buf, rows, rows.shape[0], short_receives=True), rows)
        exact = encode_inter(rows, short_receives=False)
        assert exact.numel() == rows.numel() * rows.element_size()
        assert _same_bits(decode_inter(exact, rows, rows.shape[0], short_receives=False), rows)
    repeated = (base[[0, 1, 0, 2, 1, 0, 4]] if dtype != torch.bool else base[[0, 0, 0, 0]])
    assert encode_inter(repeated, short_receives=True).numel() < repeated.numel() * repeated.element_size()


# ---- in-process fabric: every rank a thread, every message recorded --------------------------


class Fabric:
    """Point-to-point mailboxes between the threads of one simulated group."""

    def __init__(self, layout: NodeLayout, short_receives: bool):
        self.layout, self.short_receives = layout, short_receives
        self.boxes: dict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.sent: list[tuple[int, int, str, int]] = []  # (source, dest, phase, bytes)

    def exchange(self, me: int):
        def exchange(phase, sends, receives):
            assert me not in sends and me not in receives, "a rank never messages itself"
            for dest, buf in sends.items():
                with self.lock:
                    self.boxes[(me, dest, phase)].put(buf.clone())
                    self.sent.append((me, dest, phase, buf.numel()))
            for source, buf in receives.items():
                with self.lock:
                    box = self.boxes[(source, me, phase)]
                message = box.get(timeout=20)
                if self.short_receives:
                    assert message.numel() <= buf.numel(), (phase, source, me)
                else:
                    assert message.numel() == buf.numel(), (phase, source, me)
                buf[: message.numel()] = message

        return exchange


def flat_reference(rows: list[torch.Tensor], sends: list[list[int]]) -> list[torch.Tensor]:
    size = len(rows)
    pieces = [list(rows[s].split(sends[s])) for s in range(size)]
    return [torch.cat([pieces[s][d] for s in range(size)]) for d in range(size)]


def run_fabric(layout: NodeLayout, rows: list[torch.Tensor], sends: list[list[int]], short_receives: bool = True):
    size = layout.size
    recvs = [[sends[s][d] for s in range(size)] for d in range(size)]
    fabric, results, errors = Fabric(layout, short_receives), [None] * size, []

    def rank(me):
        try:
            results[me] = hierarchical_all_to_all(
                rows[me], sends[me], recvs[me], me, layout, fabric.exchange(me), lambda phase, sent: None, short_receives=short_receives
            )
        except BaseException as error:  # noqa: BLE001
            errors.append((me, traceback.format_exc()))

    threads = [threading.Thread(target=rank, args=(me,)) for me in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results, fabric


def dispatch_case(size: int, seed: int, top_k: int, hidden=(6,), dtype=torch.float64, empty=()):
    """Rows as an MoE dispatch makes them: each token copied once per chosen rank, uneven."""
    g = torch.Generator().manual_seed(seed)
    rows, sends = [], []
    for r in range(size):
        tokens = 0 if r in empty else 3 + (r * 5 + seed) % 7
        x = (torch.randn(tokens, *hidden, generator=g) * 8).to(dtype)
        picks = [torch.randperm(size, generator=g)[:top_k] for _ in range(tokens)]
        send = [sum(int((p == d).any()) for p in picks) for d in range(size)]
        index = [t for d in range(size) for t, p in enumerate(picks) if (p == d).any()]
        rows.append(x[index] if index else x.new_empty((0, *hidden)))
        sends.append(send)
    return rows, sends


LAYOUTS = {
    "2 nodes x 2": (0, 0, 1, 1),
    "3 nodes x 2": (0, 0, 1, 1, 2, 2),
    "2 nodes x 3": (0, 0, 0, 1, 1, 1),
    "uneven 3 + 1": (0, 0, 0, 1),
    "uneven 1 + 4": (0, 1, 1, 1, 1),
    "one rank per node": (0, 1, 2),
    "interleaved nodes": (0, 1, 0, 1),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("short_receives", [True, False], ids=["gloo", "exact sizes"])
def test_equals_flat_bit_for_bit_and_sends_one_message_per_remote_node(layout, short_receives):
    layout = NodeLayout(layout)
    size = layout.size
    for seed, top_k, hidden, dtype, empty in [
        (0, 2, (6,), torch.float64, ()),
        (1, 1, (2, 3), torch.float32, (1,)),  # a rank with nothing to send or receive from itself
        (2, min(3, size), (5,), torch.bfloat16, (0, size - 1)),
        (3, 2, (), torch.int64, ()),  # rows of one value each (1-D tensors)
    ]:
        rows, sends = dispatch_case(size, seed, top_k, hidden, dtype, empty)
        got, fabric = run_fabric(layout, rows, sends, short_receives)
        for me, (g, want) in enumerate(zip(got, flat_reference(rows, sends))):
            assert _same_bits(g, want), (seed, me)
        crossing = defaultdict(int)
        for source, dest, phase, _ in fabric.sent:
            if layout.nodes[source] != layout.nodes[dest]:
                assert phase == "inter-node"
                assert dest == layout.forwarder(source, layout.nodes[dest])
                crossing[(source, layout.nodes[dest])] += 1
            else:
                assert phase != "inter-node"
        assert all(n == 1 for n in crossing.values())


def test_all_empty_sends_only_the_count_headers_inside_the_node():
    layout = NodeLayout((0, 0, 1, 1))
    rows = [torch.zeros(0, 4) for _ in range(4)]
    got, fabric = run_fabric(layout, rows, [[0] * 4 for _ in range(4)])
    assert all(g.shape == (0, 4) for g in got)
    # each rank tells its node-mate it receives 0 rows from the source the mate forwards for it
    assert sorted(fabric.sent) == [(0, 1, "intra-node counts and rows", 8), (1, 0, "intra-node counts and rows", 8),
                                   (2, 3, "intra-node counts and rows", 8), (3, 2, "intra-node counts and rows", 8)]


def test_distinct_rows_cost_one_header_per_message_and_repeats_cross_once():
    layout = NodeLayout((0, 0, 1, 1))
    g = torch.Generator().manual_seed(5)
    sends = [[2, 3, 1, 4], [0, 2, 5, 1], [3, 3, 3, 3], [1, 0, 0, 2]]
    rows = [torch.randn(sum(s), 8, generator=g, dtype=torch.float64) for s in sends]
    _, fabric = run_fabric(layout, rows, sends)
    flat_inter = sum(sends[s][d] * 64 for s in range(4) for d in range(4) if layout.nodes[s] != layout.nodes[d])
    inter = sum(n for s, d, phase, n in fabric.sent if phase == "inter-node")
    assert inter == flat_inter + 8 * 4  # every rank one message to the other node, each with an 8-byte header
    # every token to both ranks of the other node: each crosses once
    token = torch.randn(4, 8, generator=g, dtype=torch.float64)
    rows = [torch.cat([token[r : r + 1]] * 2) for r in range(4)]
    sends = [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    got, fabric = run_fabric(layout, rows, sends)
    assert all(_same_bits(a, b) for a, b in zip(got, flat_reference(rows, sends)))
    inter = sum(n for s, d, phase, n in fabric.sent if phase == "inter-node")
    assert inter == 4 * (8 + 8 + 64)  # header, two int32 indices, one row


# ---- gloo, one process per rank ----------------------------------------------------------------


def hierarchical_gloo(rank: int, world_size: int, ranks_per_node: int) -> dict:
    """Flat and hierarchical on the same rows through the scheduler and the commfx op, forward
    and backward, float64 and float32; the messages each algorithm sends, by destination node."""
    import torch.distributed as dist

    from commfx.plan import Topology
    from commfx.runtime.comm import CommScheduler, active, build_groups

    topology = Topology(world_size=world_size, ranks_per_node=ranks_per_node)
    scheduler = CommScheduler(topology, rank, build_groups(topology, rank), timeout_s=60)
    sent_to: list[int] = []
    isend = dist.isend

    def counting_isend(tensor, dst=None, *args, **kwargs):
        sent_to.append(dst)
        return isend(tensor, dst, *args, **kwargs)

    dist.isend = counting_isend
    results = {}
    cases = {}
    for seed, top_k, dtype, empty in [(10, 2, torch.float64, ()), (11, 1, torch.float32, (1,)), (12, 3, torch.float32, ())]:
        rows, sends = dispatch_case(world_size, seed, top_k, (16,), dtype, empty)
        cases[f"top-{top_k} {str(dtype)[6:]}" + (" empty rank" if empty else "")] = (rows[rank], sends[rank], [sends[s][rank] for s in range(world_size)])
    for name, (x, send, recv) in cases.items():
        out = {}
        for algorithm in ("flat", "hierarchical"):
            scheduler.a2a_algorithm = algorithm
            scheduler.stats.reset()
            sent_to.clear()
            leaf = x.clone().requires_grad_(True)
            with active(scheduler):
                y = torch.ops.commfx.all_to_all(leaf, torch.tensor(send), torch.tensor(recv), "ep", "a2a", "")
                grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank + 100), dtype=y.dtype)
                (y * grad_out).sum().backward()
            out[algorithm] = (y.detach(), leaf.grad, sum(scheduler.stats.inter_node_bytes.values()), scheduler.stats.calls["all_to_all"], list(sent_to))
        (fy, fg, f_inter, _, _), (hy, hg, h_inter, h_calls, h_sent) = out["flat"], out["hierarchical"]
        my_node = topology.node_of(rank)
        results[name] = {
            "forward equal": _same_bits(fy, hy),
            "backward equal": _same_bits(fg, hg),
            "flat_inter": f_inter,
            "hier_inter": h_inter,
            "hier_calls": h_calls,  # forward and backward: one call each
            "hier_inter_messages": sum(topology.node_of(d) != my_node for d in h_sent),
        }
    dist.isend = isend
    return results


def _launch(world_size: int, ranks_per_node: int):
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    return launch("test_hierarchical_a2a:hierarchical_gloo", world_size, {"ranks_per_node": ranks_per_node}, timeout_s=240)


@pytest.mark.distributed
@pytest.mark.parametrize("nodes", [2, 3])
def test_gloo_forward_and_backward_equal_flat_with_one_message_per_remote_node(nodes):
    ranks = _launch(2 * nodes, 2)
    for rank, cases in enumerate(ranks):
        for name, result in cases.items():
            assert result["forward equal"] and result["backward equal"], (rank, name)
            assert result["hier_calls"] == 2, (rank, name)  # forward and backward, counted as one all-to-all each
            # at most one message to each remote node per all-to-all (forward, backward)
            assert result["hier_inter_messages"] <= 2 * (nodes - 1), (rank, name, result)
    # top-2 and top-3 dispatch: a token bound for both ranks of a remote node crosses once
    for name in ("top-2 float64", "top-3 float32"):
        assert sum(r[name]["hier_inter"] for r in ranks) < sum(r[name]["flat_inter"] for r in ranks), name


@pytest.mark.distributed
def test_hierarchical_equals_flat_bit_for_bit_at_2_nodes_by_2_ranks():
    from commfx.runtime.launcher import launch

    sys.path.insert(0, str(Path(__file__).parent))
    ranks = launch("locmoe_workers:hierarchical_vs_flat", 4, {"ranks_per_node": 2}, timeout_s=180)
    for rank, cases in enumerate(ranks):
        for name, result in cases.items():
            assert result["equal"], (rank, name)
    # Dispatch rows are token copies: a token bound for both ranks of the other node crosses once.
    dispatch = [cases["dispatch float64"] for cases in ranks]
    assert sum(r["hier_inter"] for r in dispatch) < sum(r["flat_inter"] for r in dispatch)
    assert all(cases["all empty"]["rows"] == 0 for cases in ranks)
    assert ranks[1]["uneven and empty"]["flat_inter"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_with_hierarchical_a2a_equals_the_model_at_world_4():
    """Outputs and every gradient (the backward all-to-alls run hierarchically too) <= 1e-10."""
    plan = Plan.from_cli("lift,expert_parallel,hierarchical_a2a", world_size=4, ranks_per_node=2)
    (report,) = verify([VerifyCase("gpt-moe", plan, batch=6)], 4, timeout_s=600)
    assert report.ok, (report.failures, report.max_diff)


@pytest.mark.parametrize("ranks_per_node", [0, 4])
def test_a_plan_without_nodes_is_a_clear_error(ranks_per_node):
    plan = Plan.from_cli("lift,expert_parallel,hierarchical_a2a", world_size=4, ranks_per_node=ranks_per_node)
    with pytest.raises(PlanError, match="spans nodes"):
        check_plan(plan)
