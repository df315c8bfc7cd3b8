"""All-to-all time against message size on the emulated 100 Mbit/s link (2026-12-03 notebook
entry): 2 nodes x 1 rank, gloo, calls back to back after an idle gap, median of `ROUNDS`;
efficiency = wire time at the link's rate / measured time. Two counts of calls: `CALLS`,
where the tc token bucket's burst (about 20 KB, bench/cluster.py) carries the small
messages faster than the link's rate, and a stream of at least `STREAM_BYTES` a size, as a
step's chunks run (the curve a machine probe would time for partition_a2a's cost model).
Run (root): .venv/bin/python benchmarks/log/2026-12-03-a2a_size_curve.py [ROUNDS]"""
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = [4096 << i for i in range(9)]  # bytes per peer: 4 KiB .. 1 MiB
CALLS, STREAM_BYTES, RATE_BITS = 4, 512 * 1024, 100e6


def worker(rounds: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(os.environ["NODE_RANK"]), world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
    out = {}
    for size in SIZES:
        x = torch.zeros(2 * size // 4)
        y = torch.empty_like(x)
        for calls in (CALLS, max(CALLS, STREAM_BYTES // size)):
            samples = []
            for _ in range(rounds + 1):
                time.sleep(0.05)  # idle gap: the link's queue drains
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    dist.all_to_all_single(y, x)
                samples.append((time.perf_counter() - start) / calls)
            per_call = statistics.median(samples[1:])
            out[f"{size} {calls}"] = {"per_call_s": per_call, "efficiency": size * 8 / RATE_BITS / per_call}
    if dist.get_rank() == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


def main(rounds: int) -> None:
    from commfx.bench.cluster import EmulatedCluster
    from commfx.bench.links import LinkSpec

    with EmulatedCluster(2, 1, LinkSpec.parse("100mbit"), allow_fallback=False) as cluster:
        port = cluster.suggest_port()
        procs = []
        for rank in range(2):
            launch = cluster.rank_launch(rank)
            env = {**os.environ, **launch.env, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([*launch.prefix, sys.executable, __file__, "--worker", str(rounds)], env=env,
                                          stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    for key, figures in json.loads(outputs[0]).items():
        size, calls = map(int, key.split())
        print(f"{size // 1024:5d} KiB per peer, {calls:3d} calls: {figures['per_call_s'] * 1e3:7.2f} ms a call, "
              f"efficiency {figures['efficiency']:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
