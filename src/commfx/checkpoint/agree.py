"""One outcome for every rank: a step of a collective save that fails on one rank fails on all.

Without it, a rank whose write failed raises while its peers wait in the next barrier until
the time bound, and their errors never name the cause. Here each rank runs its part, the
ranks exchange what went wrong (one small all-gather, which is also the barrier the step
needed), and every rank raises at once: the first rank that failed with its error, naming
itself and what it was doing; the others with one line pointing to it, so a torchrun log
says the cause once."""

from __future__ import annotations

from typing import Callable, TypeVar

from .state import CheckpointError

T = TypeVar("T")


class SharedFailure(CheckpointError):
    """A failure of one rank raised on every rank. `first_rank` is the rank that failed (its
    error is the one to print once); the others raise it to stop at the same point."""

    def __init__(self, message: str, first_rank: int):
        super().__init__(message)
        self.first_rank = first_rank


def agree(scheduler, what: str, action: Callable[[], T], *, on_rank: int | None = None) -> T | None:
    """Run `action` (only on `on_rank` when given, elsewhere nothing) and return its result;
    if it raised on any rank, raise SharedFailure on every rank: '<what> failed on rank R:
    <its error>'. Collective: every rank calls it at the same point."""
    result, error = None, None
    if on_rank is None or scheduler.rank == on_rank:
        try:
            result = action()
        except Exception as caught:  # any failure is every rank's: the peers must not wait for it
            error = str(caught) if isinstance(caught, CheckpointError) else f"{type(caught).__name__}: {caught}"
    failures = [(rank, e) for rank, e in enumerate(scheduler.all_gather_object(error)) if e]
    if failures:
        rank, first = failures[0]
        if scheduler.rank == rank:
            raise SharedFailure(f"{what} failed on rank {rank}: {first}", rank)
        raise SharedFailure(f"{what} failed on rank {rank} (rank {rank} prints why); rank {scheduler.rank} stopped with it", rank)
    return result
