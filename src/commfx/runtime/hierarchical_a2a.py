"""Hierarchical all-to-all: one message per remote node crosses the link, forwarded inside it.

The flat all-to-all sends every row straight to its destination rank, and gloo's
all_to_all_single talks to every rank of the group, zero-length messages included. Here
(DeepEP's internode dispatch: RDMA to the rank of the same local index, then NVLink
forwarding; Tutel's 2DH all-to-all) an all-to-all is three exchanges, each between only
the ranks that have something to say to each other:

1. **intra-node** (node-mates only): each rank hands each node-mate, in one byte buffer,
   the row counts that node-mate needs to receive for it from other nodes (the counts
   this rank receives from the sources that node-mate forwards for) and its own rows for
   that node-mate. Sizes need no exchange: each rank knows how many rows it receives from
   every source (`recv_rows`), and every count header has a fixed length.
2. **inter-node** (one message per remote node): the rows a rank sends to the ranks of a
   remote node go, as one message, to that node's *forwarder* for it (the rank of the
   same local index: a rail). After step 1 the forwarder knows how many rows come, so the
   message needs no size exchange either. Rows are deduplicated bit for bit (an MoE
   dispatch sends a token once per chosen rank; a token bound for two ranks of one node
   crosses once); the message then carries an 8-byte header, the unique rows and an int32
   index per row, and is sent only where it is shorter than the rows themselves. That
   needs a transport whose receive may be longer than the message (gloo's: its TCP pair
   accepts any message up to the posted length); other transports send the rows as they
   are, with exact sizes and no header.
3. **intra-node** (node-mates only): each forwarder hands each node-mate the rows it
   received for it.

Only step 2 touches the inter-node link: one message per (rank, remote node) and one
latency, as the flat all-to-all's one. The receiver puts the rows in flat order (source
index order), so the result is the flat all-to-all's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# exchange(phase, sends, receives): send each uint8 buffer of `sends` to its group index
# and receive from each index of `receives` into its uint8 buffer (a message may be shorter
# than its buffer only when the transport allows short receives); returns when all are done
Exchange = Callable[[str, dict[int, torch.Tensor], dict[int, torch.Tensor]], None]
# count(phase, bytes sent to each group index) -> None
Count = Callable[[str, dict[int, int]], None]

PHASES = ("intra-node counts and rows", "inter-node", "intra-node forward")
RAW = -1  # inter-node header: the rows follow as they are


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

    def forwarded_by(self, f: int) -> list[int]:
        """The sources on other nodes whose rows for `f`'s node `f` receives, in index order."""
        return [s for s in range(self.size) if self.nodes[s] != self.nodes[f] and self.forwarder(s, self.nodes[f]) == f]


def algorithm_for(tag: str, sites: dict[str, str], default: str) -> str:
    """The algorithm of the all-to-all tagged `tag`: that of the longest site key the tag
    starts with (the key itself, or the key and a space: "layers.0.moe dispatch" covers its
    chunks "... 2/4", micro-batches "... mb 1/2" and backward "... (bw)"), else `default`.
    `sites` is hierarchical_a2a:enabled=auto's choice per MoE block's dispatch and combine."""
    best = None
    for key in sites:
        if (tag == key or tag.startswith(key + " ")) and (best is None or len(key) > len(best)):
            best = key
    return sites[best] if best is not None else default


def _word_view(rows: torch.Tensor) -> torch.Tensor:
    """The rows' bits as an (n, words) integer tensor, the widest integer that divides a row."""
    n = rows.shape[0]
    raw = rows.reshape(n, -1).contiguous().view(torch.uint8) if rows.dtype != torch.uint8 else rows.reshape(n, -1).contiguous()
    width = raw.shape[1]
    for view, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if width % size == 0:
            return raw.view(view)
    return raw


_PROBE_WORDS = 8
_PROBE_WEIGHTS = torch.randint(-(2**62), 2**62, (_PROBE_WORDS,), generator=torch.Generator().manual_seed(0x2A2A)) | 1


def unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, index of each row into them), comparing bits so -0.0 != 0.0 and NaN == NaN.

    A hash of each row's first words finds candidate repeats; every repeat is then compared
    with its representative in full (so a hash collision can never merge two rows), and a
    collision falls back to torch.unique over the whole rows."""
    n = rows.shape[0]
    if n == 0 or rows[0].numel() == 0:
        return rows, torch.arange(n, dtype=torch.int32)
    words = _word_view(rows)
    probe = words[:, :_PROBE_WORDS].to(torch.int64)
    keys = (probe * _PROBE_WEIGHTS[: probe.shape[1]]).sum(1)  # wraps around: a hash, not a value
    unique_keys, inverse = torch.unique(keys, return_inverse=True)
    if unique_keys.shape[0] == n:
        return rows, torch.arange(n, dtype=torch.int32)
    positions = torch.arange(n)
    first = torch.full((unique_keys.shape[0],), n, dtype=torch.int64).scatter_reduce(0, inverse, positions, "amin")
    representative = first[inverse]
    repeats = (representative != positions).nonzero().flatten()
    if not torch.equal(words[repeats], words[representative[repeats]]):  # same probe, other bits
        _, inverse = torch.unique(words, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.int64).scatter_reduce(0, inverse, positions, "amin")
    return rows[first], inverse.to(torch.int32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _rows(buf: torch.Tensor, like: torch.Tensor, n: int) -> torch.Tensor:
    """`n` rows shaped like `like`'s from the front of the uint8 buffer `buf`."""
    raw = buf[: n * _row_bytes(like)]
    if like.element_size() > 1 and raw.storage_offset() % like.element_size():
        raw = raw.clone()  # misaligned for the wider type
    return (raw if like.dtype == torch.uint8 else raw.view(like.dtype)).reshape(n, *like.shape[1:])


def _pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def encode_inter(rows: torch.Tensor, short_receives: bool) -> torch.Tensor:
    """One inter-node message: the rows, or (header, index, unique rows) where shorter."""
    if not short_receives:
        return _bytes(rows)
    n, row_bytes = rows.shape[0], _row_bytes(rows)
    unique, index = unique_rows(rows)
    u = unique.shape[0]
    if u < n and _pad8(4 * n) + u * row_bytes < n * row_bytes:
        header = torch.tensor([u], dtype=torch.int64)
        index_bytes = torch.zeros(_pad8(4 * n), dtype=torch.uint8)
        index_bytes[: 4 * n] = _bytes(index)
        return torch.cat([_bytes(header), index_bytes, _bytes(unique)])
    return torch.cat([_bytes(torch.tensor([RAW], dtype=torch.int64)), _bytes(rows)])


def inter_bound(n: int, row_bytes: int, short_receives: bool) -> int:
    """The longest message `encode_inter` makes for `n` rows (its exact length without short receives)."""
    return (8 if short_receives else 0) + n * row_bytes


def decode_inter(buf: torch.Tensor, like: torch.Tensor, n: int, short_receives: bool) -> torch.Tensor:
    if not short_receives or n == 0:  # no rows: no message
        return _rows(buf, like, n)
    u = int(buf[:8].clone().view(torch.int64)[0])
    if u == RAW:
        return _rows(buf[8:], like, n)
    index = buf[8 : 8 + 4 * n].clone().view(torch.int32).long()
    return _rows(buf[8 + _pad8(4 * n) :], like, u)[index]


def hierarchical_all_to_all(
    x: torch.Tensor,
    send_rows: list[int],
    recv_rows: list[int],
    me: int,
    layout: NodeLayout,
    exchange: Exchange,
    count: Count,
    *,
    short_receives: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flat all-to-all's result (rows grouped by source index), sent hierarchically.

    Every rank of the group calls it with its own rows and counts; `send_rows[i]` rows go
    to index i, `recv_rows[i]` come from it (the counts every all-to-all's caller knows)."""
    size, row_shape, row_bytes = layout.size, tuple(x.shape[1:]), _row_bytes(x)
    out = x.new_empty((sum(recv_rows), *row_shape)) if out is None else out
    if row_bytes == 0 or size == 0:
        return out
    x = x.contiguous()
    by_dest = list(x.split(send_rows))
    my_node = layout.nodes[me]
    mates = [m for m in layout.members(my_node) if m != me]
    forwards = {f: layout.forwarded_by(f) for f in layout.members(my_node)}

    def run(phase: int, sends: dict[int, torch.Tensor], receives: dict[int, int]) -> dict[int, torch.Tensor]:
        sends = {i: b for i, b in sends.items() if b.numel()}
        buffers = {i: torch.empty(n, dtype=torch.uint8) for i, n in receives.items() if n}
        count(PHASES[phase], {i: b.numel() for i, b in sends.items()})
        if sends or buffers:
            exchange(PHASES[phase], sends, buffers)
        return {i: buffers.get(i, torch.empty(0, dtype=torch.uint8)) for i in receives}

    # ---- 1. node-mates: the counts each needs to receive what it forwards for me, and my rows for it
    got = run(
        0,
        {m: torch.cat([_bytes(torch.tensor([recv_rows[s] for s in forwards[m]], dtype=torch.int64)), _bytes(by_dest[m])]) for m in mates},
        {m: 8 * len(forwards[me]) + recv_rows[m] * row_bytes for m in mates},
    )
    header = 8 * len(forwards[me])
    # rows[s][d]: how many rows source s sends node-mate d (for the sources I forward)
    rows_to = {s: {me: recv_rows[s]} for s in forwards[me]}
    for m in mates:
        for s, n in zip(forwards[me], got[m][:header].clone().view(torch.int64).tolist()):
            rows_to[s][m] = n
    from_source = {m: _rows(got[m][header:], x, recv_rows[m]) for m in mates}
    from_source[me] = by_dest[me]

    # ---- 2. one message per remote node, to my forwarder there
    sends = {}
    for node in layout.node_ids():
        if node != my_node:
            members = layout.members(node)
            if sum(send_rows[d] for d in members):
                sends[layout.forwarder(me, node)] = encode_inter(torch.cat([by_dest[d] for d in members]), short_receives)
    my_members = layout.members(my_node)
    incoming = {s: sum(rows_to[s][d] for d in my_members) for s in forwards[me]}
    got = run(1, sends, {s: inter_bound(n, row_bytes, short_receives) if n else 0 for s, n in incoming.items()})
    forwarded = {s: decode_inter(got[s], x, incoming[s], short_receives).split([rows_to[s][d] for d in my_members]) for s in forwards[me]}
    for s in forwards[me]:
        from_source[s] = forwarded[s][my_members.index(me)]

    # ---- 3. node-mates: the rows I received for them
    got = run(
        2,
        {d: _bytes(torch.cat([forwarded[s][my_members.index(d)] for s in forwards[me]])) if forwards[me] else x.new_empty((0, *row_shape)) for d in mates},
        {f: sum(recv_rows[s] for s in forwards[f]) * row_bytes for f in mates},
    )
    for f in mates:
        pieces = _rows(got[f], x, sum(recv_rows[s] for s in forwards[f])).split([recv_rows[s] for s in forwards[f]])
        from_source.update(zip(forwards[f], pieces))

    # ---- the flat order: source by source
    offset = 0
    for s in range(size):
        n = recv_rows[s]
        if n:
            out[offset : offset + n].copy_(from_source[s])
        offset += n
    return out


def _row_bytes(template: torch.Tensor) -> int:
    per_row = 1
    for extent in template.shape[1:]:
        per_row *= extent
    return per_row * template.element_size()
