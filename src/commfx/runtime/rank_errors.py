"""Under torchrun, a commfx error that every rank raises is printed once, without a traceback.

Each torchrun rank is its own process, so an uncaught exception prints its traceback once
per rank: a refused plan, a failed save or a backend error (dynamo's BackendCompilerFailed,
about 40 lines) fills a log N times over. The hook below prints a user's error (an
exception of commfx's own that says what to fix) as one `error:` line on the rank that
failed first (rank 0 unless the error names another), and one line pointing to it on the
others. Any other exception keeps Python's traceback; COMMFX_TRACEBACK=1 keeps them all.

torchrun stops every rank as soon as one exits, so a rank that only points to the message
waits (at most PRINT_WAIT_S) until the printing rank says in the process group's store
that it has printed: otherwise the message can be lost to that stop."""

from __future__ import annotations

import os
import sys

TRACEBACK_VARIABLE = "COMMFX_TRACEBACK"
_USER_ERRORS = (ValueError, LookupError)  # commfx's PlanError, CheckpointError, InputError are ValueErrors
_USER_ERROR_NAMES = {"CaptureError", "PassError", "CommError", "LaunchError"}
PRINT_WAIT_S = 10.0
_PRINTED_KEY = "commfx/error_printed"


def user_error(error: BaseException) -> BaseException | None:
    """The commfx error a user has to fix inside `error` (itself, or what dynamo wrapped), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        from_commfx = type(error).__module__.startswith("commfx.")
        if from_commfx and (isinstance(error, _USER_ERRORS) or type(error).__name__ in _USER_ERROR_NAMES):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


def print_once(error: BaseException, rank: int, stream=None) -> bool:
    """Print `error` as torchrun's rank `rank` should, if it is a commfx user error: the
    message on the first failing rank, one pointer line elsewhere. False: not such an error."""
    stream = stream or sys.stderr
    found = user_error(error)
    if found is None:
        return False
    first = getattr(found, "first_rank", 0)
    if rank == first:
        wrapped = f" (raised inside {type(error).__name__})" if found is not error else ""
        print(f"error: {found}{wrapped}", file=stream, flush=True)
    else:
        print(f"rank {rank} stopped: {type(found).__name__} (rank {first} prints it)", file=stream, flush=True)
    return True


def _first_rank(error: BaseException) -> int:
    return getattr(user_error(error), "first_rank", 0)


def _store():
    """The default process group's store, or None before `init_process_group`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def hand_over(rank: int, first: int, store=None, wait_s: float = PRINT_WAIT_S) -> None:
    """The printing rank records that it printed; the others wait for that record, bounded."""
    store = store if store is not None else _store()
    if store is None:
        return
    from datetime import timedelta

    try:
        if rank == first:
            store.set(_PRINTED_KEY, "1")
        else:
            store.wait([_PRINTED_KEY], timedelta(seconds=wait_s))
    except (RuntimeError, ValueError):  # the store is gone or the wait timed out: exit anyway
        pass


def install() -> None:
    """Set the hook once per process, under torchrun only (it sets RANK and LOCAL_RANK)."""
    if getattr(sys.excepthook, "commfx", False) or "LOCAL_RANK" not in os.environ or os.environ.get(TRACEBACK_VARIABLE) == "1":
        return
    previous = sys.excepthook

    def hook(kind, error, trace):
        rank = int(os.environ.get("RANK", "0") or 0)
        if print_once(error, rank):
            hand_over(rank, _first_rank(error))
        else:
            previous(kind, error, trace)

    hook.commfx = True
    sys.excepthook = hook


__all__ = ["hand_over", "install", "print_once", "user_error"]
