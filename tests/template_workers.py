"""Functions the rank-template tests run on every rank."""

import os
import sys
import time

import torch
import torch.distributed as dist


def describe(rank: int, world_size: int) -> dict:
    """What a rank sees of itself: who it is, where, under which environment, and a collective."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "env_rank": os.environ["RANK"],
        "world_size": world_size,
        "pid": os.getpid(),
        "parent": os.getppid(),
        "cwd": os.getcwd(),
        "marker": os.environ.get("COMMFX_TEST_MARKER"),
        "threads": torch.get_num_threads(),
        "this_module_from": __file__,
        "all_reduce": total.item(),
        "main_module": sys.modules["__main__"].__file__ if hasattr(sys.modules["__main__"], "__file__") else None,
    }


def sleep_forever(rank: int, world_size: int) -> None:
    while True:
        time.sleep(1)
