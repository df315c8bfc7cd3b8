"""One all-to-all, flat against hierarchical, on the emulated cluster (issue 30, item 3).

Every rank builds an MoE dispatch of `tokens` tokens (hidden 128, float32), each copied
to `top_k` distinct random ranks, and runs the same all-to-all with both algorithms,
interleaved, behind a barrier each; the time is the slowest rank's, the median over
`--reps`. Also the combine's shape (the rows sent back: no repeats). Prints a table and
writes JSON.

    python benchmarks/hierarchical_a2a_micro.py --nodes 2 --ranks-per-node 2 --link 1gbit,1ms \
        --json benchmarks/hierarchical_a2a_micro_2x2_1gbit_1ms.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def worker(rank: int, world_size: int, ranks_per_node: int, sizes: list[int], top_ks: list[int], reps: int, hidden: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from commfx.plan import Topology
    from commfx.runtime.comm import CommScheduler, build_groups

    torch.set_num_threads(1)
    topology = Topology(world_size=world_size, ranks_per_node=ranks_per_node)
    scheduler = CommScheduler(topology, rank, build_groups(topology, rank, timeout_s=120), timeout_s=120)
    rows_out = []
    for tokens in sizes:
        for top_k in top_ks:
            g = torch.Generator().manual_seed(1000 * rank + tokens + top_k)
            x = torch.randn(tokens, hidden, generator=g)
            picks = [torch.randperm(world_size, generator=g)[:top_k] for _ in range(tokens)]
            index = [t for d in range(world_size) for t, p in enumerate(picks) if (p == d).any()]
            send = [sum(int((p == d).any()) for p in picks) for d in range(world_size)]
            rows = x[index]
            ones = [1] * world_size
            recv = scheduler.all_to_all(torch.tensor([send]).repeat(world_size, 1), ones, ones, "ep")[:, rank].tolist()
            for shape, (s, r, payload) in {"dispatch": (send, recv, rows), "combine": (recv, send, None)}.items():
                payload = payload if payload is not None else torch.randn(sum(s), hidden, generator=g)
                times = {"flat": [], "hierarchical": []}
                inter = {}
                for rep in range(reps + 1):
                    for algorithm in ("flat", "hierarchical"):
                        scheduler.a2a_algorithm = algorithm
                        scheduler.stats.reset()
                        dist.barrier()
                        start = time.perf_counter()
                        scheduler.all_to_all(payload, s, r, "ep")
                        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                        dist.all_reduce(took, op=dist.ReduceOp.MAX)
                        if rep:  # the first is a warm-up
                            times[algorithm].append(float(took))
                        inter[algorithm] = sum(scheduler.stats.inter_node_bytes.values())
                total_inter = torch.tensor([inter["flat"], inter["hierarchical"]], dtype=torch.float64)
                dist.all_reduce(total_inter)
                rows_out.append({
                    "tokens_per_rank": tokens, "top_k": top_k, "shape": shape, "rows_sent_by_rank": sum(s),
                    "flat_ms": 1e3 * statistics.median(times["flat"]), "hierarchical_ms": 1e3 * statistics.median(times["hierarchical"]),
                    "flat_inter_bytes": int(total_inter[0]), "hierarchical_inter_bytes": int(total_inter[1]),
                })
    return rows_out


def main() -> None:
    from commfx.bench.cluster import EmulatedCluster
    from commfx.bench.links import LinkSpec
    from commfx.runtime.launcher import RankEnvironment, launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--link", default="1gbit,1ms")
    parser.add_argument("--sizes", default="16,128,512,2048", help="tokens per rank")
    parser.add_argument("--top-k", default="1,2")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    recorder = RunRecorder()
    world = args.nodes * args.ranks_per_node
    with EmulatedCluster(args.nodes, args.ranks_per_node, LinkSpec.parse(args.link)) as cluster:
        def environment(rank: int) -> RankEnvironment:
            spec = cluster.rank_launch(rank)
            return RankEnvironment(prefix=list(spec.prefix), env=dict(spec.env))

        results = launch(
            "hierarchical_a2a_micro:worker", world,
            {"ranks_per_node": args.ranks_per_node, "sizes": [int(v) for v in args.sizes.split(",")],
             "top_ks": [int(v) for v in args.top_k.split(",")], "reps": args.reps, "hidden": args.hidden},
            timeout_s=1200, rank_environment=environment, master_addr=cluster.master_addr, master_port=cluster.suggest_port(),
        )
        described = cluster.describe()
    rows = results[0]
    print(f"{described}; {world} ranks on the machine's cores; median of {args.reps}, slowest rank")
    print(f"{'tokens/rank':>11} {'top-k':>5} {'shape':>8} {'flat ms':>8} {'hier ms':>8} {'hier/flat':>9} {'flat inter B':>13} {'hier inter B':>13}")
    for r in rows:
        print(f"{r['tokens_per_rank']:>11} {r['top_k']:>5} {r['shape']:>8} {r['flat_ms']:>8.2f} {r['hierarchical_ms']:>8.2f} "
              f"{r['hierarchical_ms'] / r['flat_ms']:>9.2f} {r['flat_inter_bytes']:>13,} {r['hierarchical_inter_bytes']:>13,}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": described, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "link": args.link,
                       "reps": args.reps, "hidden": args.hidden, "dtype": "float32", "rows": rows, "run": recorder.finish()}, f, indent=1)


if __name__ == "__main__":
    main()
