"""A rank's pieces of a model-level tensor, in the form `torch.distributed.checkpoint` reads.

A parameter a rank holds only part of (an expert-parallel stack, a packed layer whose slots
hold experts in another order, a tensor-parallel shard of heads) is saved as the full
tensor's name and shape plus the chunks this rank holds, each at its offset in the full
tensor: what DTensor gives DCP, for layouts DTensor cannot state (a packed layer's rows are
a permutation of experts). DCP then writes each chunk once (replicas are deduplicated) and
loads any other set of chunks of the same tensor, so a checkpoint saved at one layout
loads at another. The chunks are views of the live tensors: loading writes into them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class Chunks:
    """`pieces`: (offsets in the full tensor, a view of this rank's tensor) for each chunk."""

    def __init__(self, size: torch.Size, pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self._size = torch.Size(size)
        self.pieces = pieces

    def size(self) -> torch.Size:  # DCP compares this with the saved size
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.size()),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=self._size,
                ),
            )
            for offsets, piece in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.size()) for offsets, piece in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, piece in self.pieces:
            if torch.Size(offsets) == index.offset:
                return piece
        raise ValueError(f"{index.fqn}: no chunk at offset {tuple(index.offset or ())} on this rank")


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices."""
    out: list[tuple[int, int, int]] = []
    for local, index in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == index:
            start, first, length = out[-1]
            out[-1] = (start, first, length + 1)
        else:
            out.append((local, index, 1))
    return out


def chunks_of(tensor: torch.Tensor, dim: int, indices: list[int], full: int) -> Chunks:
    """`tensor` as chunks of a tensor whose `dim` has `full` entries, local entry i being
    entry `indices[i]` of the full tensor."""
    size = list(tensor.shape)
    size[dim] = full
    pieces = []
    for local, index, length in runs(indices):
        offsets = [0] * tensor.dim()
        offsets[dim] = index
        pieces.append((tuple(offsets), tensor.narrow(dim, local, length)))
    return Chunks(torch.Size(size), pieces)


def _find(state: dict, index: MetadataIndex):
    obj = state[index.fqn]
    if isinstance(obj, Chunks):
        return obj.__get_tensor_shard__(index)
    return None


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding a chunk of a `Chunks` value by its offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _find(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, writing into the chunks of a `Chunks` value (kept out of the
    default set-up, which would replace a value of a type it does not know by None)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        chunked = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in chunked}, metadata, is_coordinator)
        self.state_dict.update(chunked)
        self.original_state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _find(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the fewest boxes covering elements [lo, hi) of a row-major tensor
    of `shape`, in order; each box is contiguous in that order (a flat range of a ZeRO
    shard, which is no box itself, is at most 2 * dims - 1 of them)."""
    if hi <= lo:
        return []
    if not shape:
        return [((), ())]
    inner = 1
    for d in shape[1:]:
        inner *= d
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        return [((first, *[0] * (len(shape) - 1)), (last - first + 1, *shape[1:]))]
    out = []
    if first == last:
        return [((first, *o), (1, *s)) for o, s in boxes(shape[1:], lo - first * inner, hi - first * inner)]
    head_end = (first + 1) * inner
    if lo % inner:
        out += [((first, *o), (1, *s)) for o, s in boxes(shape[1:], lo - first * inner, inner)]
    else:
        head_end = first * inner
    tail_start = last * inner if hi % inner else hi
    if tail_start > head_end:
        out += boxes(shape, head_end, tail_start)
    if hi % inner:
        out += [((last, *o), (1, *s)) for o, s in boxes(shape[1:], 0, hi - last * inner)]
    return out


def flat_chunks(flat: torch.Tensor, shape: tuple[int, ...], lo: int, sharding=None) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces (offsets in the full tensor, view of `flat`) of `flat`, which holds elements
    [lo, lo + len) of a local tensor of `shape`; `sharding` (dim, indices, full) says which
    entries of the full tensor's dim the local tensor's are (None: the local is the full)."""
    pieces = []
    strides = torch.empty(shape, device="meta").stride() if shape else ()
    for offsets, sizes in boxes(tuple(shape), lo, lo + flat.numel()):
        start = sum(o * s for o, s in zip(offsets, strides)) - lo
        count = 1
        for s in sizes:
            count *= s
        view = flat[start : start + count].view(sizes)
        if sharding is None:
            pieces.append((offsets, view))
            continue
        dim, indices, _ = sharding
        for local, index, length in runs(indices):
            a, b = max(local, offsets[dim]), min(local + length, offsets[dim] + sizes[dim])
            if a < b:
                where = list(offsets)
                where[dim] = index + a - local
                pieces.append((tuple(where), view.narrow(dim, a - offsets[dim], b - a)))
    return pieces
