"""One rank of a launched job: join the gloo world, run the function, save its result.

Run as `python -m commfx.runtime.worker JOB_DIR RANK` by the launcher, which sets
MASTER_ADDR, MASTER_PORT and WORLD_SIZE. A failure writes the traceback to
`error_<rank>.txt` and exits non-zero so the launcher can name the failing rank.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path


def main(job_dir: str, rank_text: str) -> int:
    job_path, rank = Path(job_dir), int(rank_text)
    job = pickle.loads((job_path / "job.pkl").read_bytes())
    try:
        import torch.distributed as dist

        world_size = job["world_size"]
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=job["collective_timeout_s"]),
        )
        module_name, _, function_name = job["function"].partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        result = function(rank=rank, world_size=world_size, **job["kwargs"])
        (job_path / f"result_{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()  # nobody leaves while a peer may still talk to it
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip gloo teardown: destroying a group whose peers already left can abort the process.
        os._exit(0)
    except BaseException:
        (job_path / f"error_{rank}.txt").write_text(traceback.format_exc())
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # do not wait on collectives or threads a dead peer left hanging


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
