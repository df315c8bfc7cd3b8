"""Compression of what a pipeline boundary carries backward (Optimus-CC).

`LowRankCodec` is the object `compress_pipeline` hangs on a boundary; the pipeline runtime
calls it without knowing what it does:

- `encode(grads, state, critical)` on the stage that sends activation gradients back,
- `payload_specs(specs, critical)` and `decode(payload, specs, critical)` on the stage
  that receives them.

PowerSGD, one power iteration per send (Vogels et al., NeurIPS 2019), on each gradient M
viewed as [tokens, hidden]: Q is warm-started from the previous send of this boundary
(random the first time), P = M Q, P is orthogonalised, Q = Mᵀ P; P and Q travel and the
receiver rebuilds P Qᵀ = P Pᵀ M, the projection of M onto span(P). That is exact when
rank(M) <= r, and equal to M when r = min(tokens, hidden).

Lazy error propagation (Optimus-CC): the residual E = M - P Qᵀ is added to the next
gradient this boundary sends, before it is compressed. The stated bound: after t sends,
sum(sent) = sum(true gradients) - E_t exactly (the sum telescopes), and each step
‖E_t‖ <= ‖M_t + E_{t-1}‖ (the residual of an orthogonal projection is never larger than
what was projected). So the running sum is off by one residual, never by the sum of all
of them: directions a low rank drops are sent later instead of lost. Without feedback the
dropped part of every send stays missing, and for gradients whose directions persist
across micro-batches that gap grows linearly (tests/test_compress_pipeline.py checks both).
A send that is not compressed (outside the epilogue) carries M + E exactly and clears E.

State (Q and E per boundary tensor) lives in the runtime, keyed by boundary, and is saved
with the module's state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.powersgd import lowrank_residual, orthogonalize

Spec = tuple[torch.Size, torch.dtype]
Q_SEED = 1234


@dataclass(frozen=True)
class LowRankCodec:
    rank: int
    error_feedback: bool = True
    epilogue_only: bool = True  # compress only sends on the critical path (see runtime/pipeline/schedule.py)

    def __str__(self) -> str:
        ef = "lazy error propagation" if self.error_feedback else "no error feedback"
        where = "epilogue sends only" if self.epilogue_only else "every backward send"
        return f"PowerSGD rank {self.rank}, {ef}, {where}"

    def compresses(self, critical: bool) -> bool:
        return critical or not self.epilogue_only

    @staticmethod
    def matrix_shape(shape) -> tuple[int, int]:
        """A gradient as a matrix: [tokens, hidden] (every leading dimension is tokens)."""
        cols = shape[-1]
        rows = 1
        for size in shape[:-1]:
            rows *= size
        return rows, cols

    def factor_rank(self, shape) -> int:
        """The rank of the factors a gradient shaped `shape` travels as."""
        rows, cols = self.matrix_shape(shape)
        return min(self.rank, rows, cols)

    def _compressible(self, shape, dtype) -> bool:
        return dtype.is_floating_point and len(shape) >= 2 and min(self.matrix_shape(shape)) > 0

    def payload_specs(self, specs: list[Spec], critical: bool) -> list[Spec]:
        """The shapes and dtypes `encode` produces for gradients shaped `specs`."""
        if not self.compresses(critical):
            return list(specs)
        out = []
        for shape, dtype in specs:
            if self._compressible(shape, dtype):
                rows, cols = self.matrix_shape(shape)
                r = self.factor_rank(shape)
                out += [(torch.Size((rows, r)), dtype), (torch.Size((cols, r)), dtype)]
            else:
                out.append((shape, dtype))
        return out

    def encode(self, grads: list[torch.Tensor], state: dict[str, torch.Tensor], critical: bool) -> list[torch.Tensor]:
        payload = []
        for i, grad in enumerate(grads):
            error = state.get(f"error.{i}")
            if self.error_feedback and error is not None and error.shape == grad.shape:
                grad = grad + error
            if not (self.compresses(critical) and self._compressible(grad.shape, grad.dtype)):
                state.pop(f"error.{i}", None)  # sent exactly, residual included
                payload.append(grad)
                continue
            m = grad.reshape(self.matrix_shape(grad.shape))
            p, q = power_step(m, self._warm_q(state, i, m))
            state[f"q.{i}"] = q
            if self.error_feedback:
                state[f"error.{i}"] = lowrank_residual(m, p, q).view(grad.shape)
            payload += [p, q]
        return payload

    def decode(self, payload: list[torch.Tensor], specs: list[Spec], critical: bool) -> list[torch.Tensor]:
        out, parts = [], iter(payload)
        for shape, dtype in specs:
            if self.compresses(critical) and self._compressible(shape, dtype):
                p, q = next(parts), next(parts)
                out.append((p @ q.T).view(shape))
            else:
                out.append(next(parts))
        return out

    def _warm_q(self, state: dict[str, torch.Tensor], i: int, m: torch.Tensor) -> torch.Tensor:
        return warm_q(state.get(f"q.{i}"), m, self.rank, Q_SEED + i)


def warm_q(previous: torch.Tensor | None, m: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """Q of the previous call for this tensor; random (seeded, so every rank that seeds alike
    draws the same Q) the first time and in the columns a rank-deficient gradient zeroed
    (they would stay zero otherwise)."""
    r = min(rank, *m.shape)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    fresh = torch.randn((m.shape[1], r), generator=generator, dtype=m.dtype).to(m.device)
    if previous is None or previous.shape != fresh.shape or previous.dtype != m.dtype:
        return fresh
    empty = previous.norm(dim=0) == 0
    return torch.where(empty[None, :], fresh, previous) if bool(empty.any()) else previous


def power_step(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One PowerSGD iteration: P = orth(M Q), Q = Mᵀ P (so P Qᵀ = P Pᵀ M)."""
    p = orthogonalize(m @ q)
    return p, m.T @ p
