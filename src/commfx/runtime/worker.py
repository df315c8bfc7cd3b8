"""One rank of a launched job: join the gloo world, run the function, save its result.

Run as `python -m commfx.runtime.worker JOB_DIR RANK` by the launcher, which sets
MASTER_ADDR, MASTER_PORT and WORLD_SIZE. A failure writes the traceback to
`error_<rank>.txt` and exits non-zero so the launcher can name the failing rank.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path


def watch_parent(launcher_pid: int, every_s: float = 0.5) -> None:
    """Exit when the launcher dies, however it dies (SIGKILL included): the kernel's
    parent-death signal where there is one, and a thread that checks the parent as a backstop
    (the parent may already be gone, or be a wrapper such as `ip netns exec`'s)."""
    if not launcher_pid:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    parent = os.getppid()

    def alive() -> bool:
        # Reparenting (to init or a subreaper) happens the moment the parent dies, before
        # anyone reaps it; a wrapper that forked us is watched the same way.
        return os.getppid() == parent and parent != 1

    def watch() -> None:
        while alive():
            time.sleep(every_s)
        os._exit(3)

    if not alive() or (parent != launcher_pid and not _exists(launcher_pid)):
        os._exit(3)
    threading.Thread(target=watch, name="commfx-parent-watch", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# Exit code of rank 0 when MASTER_PORT is taken: the launcher picks another port and starts
# the job again (two launchers on one machine can pick the same free port at once).
PORT_TAKEN = 75


def join_world(job_name: str, rank: int, world_size: int, timeout: timedelta, device: str = "cpu") -> None:
    """Join this job's world: gloo, or on CUDA NCCL and gloo with this rank's GPU bound (devices.py). Rank 0 hosts the rendezvous store on MASTER_PORT. Every key
    is under the job's name, so a rank of another job that was given the same port cannot
    join this world: it waits for its own job's keys until its launcher stops it."""
    import torch.distributed as dist

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    except RuntimeError as error:  # DistNetworkError
        if rank == 0 and "EADDRINUSE" in str(error):
            os._exit(PORT_TAKEN)
        raise
    from .devices import bind_rank, process_group_backend

    bind_rank(device, rank)  # every rank of a local launch is on this machine: local rank = rank
    backend = process_group_backend(device)
    dist.init_process_group(backend, store=dist.PrefixStore(job_name, store), rank=rank, world_size=world_size, timeout=timeout)


def main(job_dir: str, rank_text: str) -> int:
    job_path, rank = Path(job_dir), int(rank_text)
    # The launcher sends SIGUSR1 before it stops a rank that is still running at a deadline:
    # every thread's stack goes to this rank's log, so the error can say what it was doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    watch_parent(int(os.environ.get("COMMFX_LAUNCHER_PID", "0")))
    job = pickle.loads((job_path / "job.pkl").read_bytes())
    try:
        import torch.distributed as dist

        world_size = job["world_size"]
        join_world(job_path.name, rank, world_size, timedelta(seconds=job["collective_timeout_s"]), job.get("device", "cpu"))
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
