"""Hierarchical all-to-all: a row crosses the inter-node link once per remote node.

The flat all-to-all sends every row straight to its destination rank. In an MoE dispatch
the rows a rank sends are copies of its tokens, one per chosen expert, so a token bound for
several ranks of a remote node crosses the slow link several times. Here (DeepEP's
internode dispatch, Tutel's 2DH all-to-all) a rank sends each remote node its rows once:

1. **inter-node** (between ranks of the same local index on every node, "rails"): for each
   remote node B, the rows bound for B's ranks are deduplicated bit for bit and the unique
   rows go to one rank of B, the *forwarder*, with a header (unique rows, rows per
   destination rank) and each row's index into the unique rows;
2. **intra-node**: every rank sends each rank of its own node the rows it delivers to it —
   its own rows for that rank, and the rows it forwards for its rail peers, expanded from
   the unique rows.

The receiver puts the rows in flat order (source rank order), so the result is the flat
all-to-all's, bit for bit: deduplication compares the rows' bits (an integer view), never
their values. Rows are deduplicated per remote node; where none repeat (combine, most
gradients) they go as they are and cost only a header of (node size + 1) int64 per peer;
otherwise each row adds a 4-byte index. Each phase is an `all_to_all_single` over the whole group with
zero splits for ranks outside the phase, so no extra process groups are needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# exchange(output, input, output_splits, input_splits): a blocking all_to_all_single on the group
Exchange = Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], None]
# count(phase, bytes sent to each group index) -> None
Count = Callable[[str, dict[int, int]], None]

_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class NodeLayout:
    """Which node each index of a group lives on, and who forwards for whom."""

    nodes: tuple[int, ...]  # node of each group index

    @property
    def size(self) -> int:
        return len(self.nodes)

    def spans_nodes(self) -> bool:
        return len(set(self.nodes)) > 1

    def node_ids(self) -> list[int]:
        return sorted(set(self.nodes))

    def members(self, node: int) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n == node]

    def local_index(self, i: int) -> int:
        return self.members(self.nodes[i]).index(i)

    def forwarder(self, source: int, node: int) -> int:
        """The rank of `node` that receives `source`'s rows for that node (same local index)."""
        members = self.members(node)
        return members[self.local_index(source) % len(members)]

    def deliverer(self, source: int, dest: int) -> int:
        """Who hands `dest` the rows `source` sends it: the source itself on the same node."""
        return source if self.nodes[source] == self.nodes[dest] else self.forwarder(source, self.nodes[dest])


def unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, index of each row into them), comparing bits so -0.0 != 0.0 and NaN == NaN."""
    n = rows.shape[0]
    view = _BIT_VIEWS.get(rows.element_size())
    if n == 0 or rows[0].numel() == 0 or view is None:
        return rows, torch.arange(n, dtype=torch.int32)
    bits = rows.reshape(n, -1).contiguous().view(view)
    unique_bits, inverse = torch.unique(bits, dim=0, return_inverse=True)
    return unique_bits.view(rows.dtype).reshape(-1, *rows.shape[1:]), inverse.to(torch.int32)


def hierarchical_all_to_all(
    x: torch.Tensor,
    send_rows: list[int],
    recv_rows: list[int],
    me: int,
    layout: NodeLayout,
    exchange: Exchange,
    count: Count,
) -> torch.Tensor:
    """The flat all-to-all's result (rows grouped by source index), sent hierarchically."""
    size, row_shape = layout.size, tuple(x.shape[1:])
    x = x.contiguous()
    by_dest = list(x.split(send_rows))
    my_node = layout.nodes[me]
    width = 1 + max(len(layout.members(n)) for n in layout.node_ids())

    # ---- phase 1: one deduplicated message per remote node, to its forwarder
    headers, indices, uniques = {}, {}, {}
    for node in layout.node_ids():
        if node == my_node:
            continue
        members = layout.members(node)
        bound = torch.cat([by_dest[d] for d in members]) if members else x[:0]
        unique, inverse = unique_rows(bound)
        if unique.shape[0] == bound.shape[0]:  # nothing repeats: the rows as they are, no index
            unique, inverse = bound, inverse[:0]
        target = layout.forwarder(me, node)
        header = torch.zeros((1, width), dtype=torch.int64)
        header[0, 0] = unique.shape[0]
        header[0, 1 : 1 + len(members)] = torch.tensor([send_rows[d] for d in members], dtype=torch.int64)
        headers[target], indices[target], uniques[target] = header, inverse, unique
    sources = [s for s in range(size) if layout.nodes[s] != my_node and layout.forwarder(s, my_node) == me]

    def phase(name: str, outgoing: dict[int, torch.Tensor], incoming_rows: dict[int, int], template: torch.Tensor):
        send = [outgoing[i].shape[0] if i in outgoing else 0 for i in range(size)]
        recv = [incoming_rows.get(i, 0) for i in range(size)]
        payload = torch.cat([outgoing[i] for i in sorted(outgoing)]) if outgoing else template[:0]
        out = template.new_empty((sum(recv), *template.shape[1:]))
        count(name, {i: send[i] * _row_bytes(template) for i in range(size) if send[i]})
        exchange(out, payload.contiguous(), recv, send)
        return dict(zip(range(size), out.split(recv)))

    got_headers = phase("hierarchical header", headers, {s: 1 for s in sources}, torch.zeros((0, width), dtype=torch.int64))
    got_headers = {s: got_headers[s].reshape(width) for s in sources}
    my_members = layout.members(my_node)
    def index_rows(source: int) -> int:
        bound = int(got_headers[source][1 : 1 + len(my_members)].sum())
        return bound if int(got_headers[source][0]) < bound else 0

    got_indices = phase("hierarchical index", indices, {s: index_rows(s) for s in sources}, torch.zeros(0, dtype=torch.int32))
    got_uniques = phase("hierarchical inter-node", uniques, {s: int(got_headers[s][0]) for s in sources}, x.new_empty((0, *row_shape)))

    # ---- phase 2: within the node, each rank hands over its own rows and what it forwards
    def forwarded(source: int, dest: int) -> torch.Tensor:
        counts = got_headers[source][1 : 1 + len(my_members)].tolist()
        position = my_members.index(dest)
        start = sum(counts[:position])
        if got_indices[source].shape[0] == 0:  # sent as they are
            return got_uniques[source][start : start + counts[position]]
        return got_uniques[source][got_indices[source][start : start + counts[position]].long()]

    outgoing = {}
    for dest in my_members:
        pieces = [
            by_dest[dest] if source == me else forwarded(source, dest)
            for source in range(size)
            if layout.deliverer(source, dest) == me
        ]
        outgoing[dest] = torch.cat(pieces) if pieces else x[:0]
    incoming = {f: sum(recv_rows[s] for s in range(size) if layout.deliverer(s, me) == f) for f in my_members}
    delivered = phase("hierarchical intra-node", outgoing, incoming, x.new_empty((0, *row_shape)))

    # ---- the flat order: source by source
    from_source: dict[int, torch.Tensor] = {}
    for f in my_members:
        served = [s for s in range(size) if layout.deliverer(s, me) == f]
        for s, rows in zip(served, delivered[f].split([recv_rows[s] for s in served])):
            from_source[s] = rows
    return torch.cat([from_source[s] for s in range(size)]) if size else x[:0]


def _row_bytes(template: torch.Tensor) -> int:
    per_row = 1
    for extent in template.shape[1:]:
        per_row *= extent
    return per_row * template.element_size()
