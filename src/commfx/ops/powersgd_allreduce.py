"""PowerSGD on a data-parallel gradient all-reduce (Optimus-CC's selective stage compression).

Optimus-CC compresses the data-parallel all-reduce only on the stages before index w: the
early stages finish backward last, so their all-reduce is what the step waits for at its
end. `compress_pipeline:dp_stages=w` hangs a `DataParallelPowerSGD` on those stages and the
pipeline runtime hands it the stage's gradients instead of all-reducing them itself.

The algorithm is PowerSGD's all-reduce (Vogels et al., NeurIPS 2019), one power iteration
per step, on each gradient matrix M_i of rank i of an n-rank group: with Q shared by every
rank (seeded alike, then the reduced Q of the previous step),

    P = sum_i M_i Q    (all-reduce 1)    P <- orth(P)
    Q = sum_i M_iᵀ P   (all-reduce 2)    reduced gradient = scale x P Qᵀ = scale x P Pᵀ sum_i M_i

so the traffic is r (rows + cols) per matrix instead of rows x cols. Every P of a stage
travels in one all-reduce and every Q in another. A weight [out, in] is one matrix; a
stack [..., rows, cols] (an MoE layer's experts) is one matrix per expert, never one
matrix across experts, whose low rank would blend experts that share no structure. A
matrix where factors save nothing (r (rows + cols) >= rows x cols), and every vector, is
all-reduced exactly by the runtime.

Error feedback: rank i keeps E_i = M_i - P Pᵀ (sum_j M_j) / n and adds it to its next
gradient. Summing over ranks, sum_i E_i = sum_i M_i - P Qᵀ, so after t steps the sum of the
reduced gradients equals the sum of the exact ones minus scale x sum_i E_i,t: one residual
behind, as at a pipeline boundary (ops/compress.py), and ‖sum_i E_i,t‖ is at most
‖sum_i (M_i,t + E_i,t-1)‖ (the residual of an orthogonal projection). Where rank(sum_i M_i) <= r
with P spanning it, the reduction is exact. State (Q and E per parameter) is saved with the
module's state_dict.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.powersgd import lowrank_residual, orthogonalize
from .compress import warm_q

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a flat tensor over the group, in place


@dataclass(frozen=True)
class DataParallelPowerSGD:
    rank: int
    error_feedback: bool = True

    def __str__(self) -> str:
        return f"PowerSGD rank {self.rank} data-parallel all-reduce" + (", error feedback" if self.error_feedback else "")

    def compresses(self, shape, dtype) -> bool:
        """Whether a gradient of this shape goes as factors (they must be smaller than it)."""
        if not dtype.is_floating_point or len(shape) < 2:
            return False
        rows, cols = shape[-2], shape[-1]
        return self.rank * (rows + cols) < rows * cols

    def reduce(
        self, grads: dict[str, torch.Tensor], state: dict[str, torch.Tensor], all_reduce: AllReduce, group_size: int, scale: float
    ) -> dict[str, torch.Tensor]:
        """The gradients (same names and order on every rank of the group) reduced as
        `scale x P Qᵀ`, in two all-reduces; updates Q and the residuals in `state`."""
        names = list(grads)
        stacks = []  # each gradient as [matrices, rows, cols], its residual added
        for name in names:
            grad = grads[name]
            m = grad.reshape(-1, grad.shape[-2], grad.shape[-1])
            error = state.get(f"error.{name}")
            if self.error_feedback and error is not None and error.shape == m.shape:
                m = m + error
            stacks.append(m)
        qs = [self._warm_q(state.get(f"q.{name}"), m, name) for name, m in zip(names, stacks)]
        ps = _reduced([m @ q for m, q in zip(stacks, qs)], all_reduce)
        ps = [torch.stack([orthogonalize(p_e) for p_e in p]) for p in ps]
        qs = _reduced([m.transpose(1, 2) @ p for m, p in zip(stacks, ps)], all_reduce)
        out = {}
        for name, m, p, q in zip(names, stacks, ps, qs):
            state[f"q.{name}"] = q
            if self.error_feedback:
                mean_q = q / group_size  # so that P mean_qᵀ is the mean of the ranks' approximations
                state[f"error.{name}"] = torch.stack([lowrank_residual(m_e, p_e, q_e) for m_e, p_e, q_e in zip(m, p, mean_q)])
            out[name] = (p @ (q * scale).transpose(1, 2)).view(grads[name].shape)
        return out

    def _warm_q(self, previous: torch.Tensor | None, m: torch.Tensor, name: str) -> torch.Tensor:
        seed = zlib.crc32(name.encode())  # the same on every rank of the group
        return torch.stack([
            warm_q(previous[e] if previous is not None and previous.shape[0] == m.shape[0] else None, m_e, self.rank, seed + e)
            for e, m_e in enumerate(m)
        ])


def _reduced(tensors: list[torch.Tensor], all_reduce: AllReduce) -> list[torch.Tensor]:
    """Sum every tensor over the group in one all-reduce."""
    if not tensors:
        return []
    flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]))
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out

