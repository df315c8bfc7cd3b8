"""`commfx plan`: search pass lists and options by simulation; print the best few, emit one."""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

from ..plan import PlanError
from .args import ACTIVATION_BUDGET_HELP, budget, positive_int

__all__ = ["add_parser", "parse_bytes"]

console = Console(highlight=False, markup=False)
wide = Console(highlight=False, markup=False, width=None if console.is_terminal else 200)  # the table, unwrapped in logs
EXAMPLE = "commfx plan gpt-moe --cluster h100 --world 16 --memory-limit auto --top 5 --emit plan.txt"
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a plan: simulate candidate pass lists and options on a cluster, rank them by predicted step",
        description=(
            "Enumerate the plans commfx simulate models (expert parallelism at each ep size, partition_a2a k, "
            "pack_experts degree, tp inside a node, pp with micro-batches and compress_pipeline rank, "
            "locality_gate for top-1 routers, split_embedding_comm for untied tables (row gradients exchanged in the backward, "
            "or with schedule=2d into the next forward), "
            "shard_states 1-3, bf16, and activation recomputation budgets for plans over the memory limit), simulate each on the "
            "cluster, drop those over the memory limit and print the "
            f"best by predicted step, with what each saves against naive expert parallelism. Example: {EXAMPLE}"
        ),
    )
    parser.add_argument("model", help="built-in name (gpt-moe, gpt-moe-tiny), hf:<model_type>, or path/to/file.py:function")
    parser.add_argument("--cluster", default="emulated", metavar="NAME|FILE", help="a preset (emulated, h100, a100) or a TOML file")
    parser.add_argument("--world", type=positive_int, default=None, help="ranks in all (default: the cluster's nodes x ranks per node)")
    parser.add_argument("--nodes", type=positive_int, default=None, help="nodes (default: world / ranks per node)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=None, help="ranks per node (default: the cluster's)")
    parser.add_argument("--inter-node", metavar="RATE[,LATENCY]", default=None, help="per-node inter-node link in tc units, e.g. 100mbit")
    parser.add_argument("--memory-limit", default="auto", metavar="BYTES|auto",
                        help="held bytes per rank a plan may need, e.g. 80e9, 40GiB, 512MB; auto: the device's memory (default)")
    parser.add_argument("--top", type=positive_int, default=5, help="plans to print (default 5)")
    parser.add_argument("--candidate", action="append", default=[], metavar="PASSES",
                        help="rank these pass lists instead of searching (repeatable; the first is the baseline)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the precision of the --candidate plans (the search tries both)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages of the --candidate plans (with pipeline_split in them)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size of the --candidate plans (with tensor_parallel)")
    parser.add_argument("--activation-memory-budget", type=budget, default=None, metavar="B",
                        help=f"of the --candidate plans (the search tries 0.5, 0.25 and 0.1 on plans over the limit, and on every "
                             f"--candidate plan when none fits): {ACTIVATION_BUDGET_HELP}")
    parser.add_argument("--emit", metavar="FILE", help="write the chosen plan's --passes string here")
    parser.add_argument("--batch", type=positive_int, default=None, help="global batch size (default: the model's)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="model config override (repeatable)")
    parser.add_argument("--rows-per-rank", type=positive_int, default=None, metavar="N",
                        help="trace one sequence per rank and simulate N (for models too large to trace at their batch here; "
                             "costs are taken as linear in rows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run)


def parse_bytes(text: str) -> float:
    """`80e9`, `40GiB`, `512MB` -> bytes; a clear error otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise PlanError(f"--memory-limit {text!r}: give bytes (80e9), a size with a unit (40GiB, 512MB) or auto")
    return float(match.group(1)) * UNITS[match.group(2)]


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.4g} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.4g} MB"


def layout(cluster, world: int | None, nodes: int | None, ranks_per_node: int | None, inter_node: str | None):
    """The cluster at `world` ranks: nodes = world / ranks per node, which must divide."""
    rpn = ranks_per_node or cluster.ranks_per_node
    if world is None:
        return cluster.with_layout(nodes, ranks_per_node, inter_node)
    if ranks_per_node is None and nodes is None and world < rpn:
        rpn = world  # fewer ranks than one node holds: one node
    if nodes is not None and ranks_per_node is None:
        if world % nodes:
            raise PlanError(f"--world {world} is not a multiple of --nodes {nodes}")
        rpn = world // nodes
    if world % rpn:
        raise PlanError(f"--world {world} is not a multiple of {rpn} ranks per node: give --ranks-per-node or --nodes")
    if nodes is not None and nodes * rpn != world:
        raise PlanError(f"--world {world} is not --nodes {nodes} x {rpn} ranks per node")
    return cluster.with_layout(world // rpn, rpn, inter_node)


def _run(args) -> int:
    from ..simulate import load_cluster
    from ..simulate.search import Candidate, search
    from .bench import _model_kwargs
    from .checks import check_output_paths

    check_output_paths({"--emit": args.emit})
    cluster = layout(load_cluster(args.cluster), args.world, args.nodes, args.ranks_per_node, args.inter_node)
    limit = cluster.device.memory_bytes if args.memory_limit == "auto" else parse_bytes(args.memory_limit)
    candidates = [Candidate(p, precision=args.precision, pp=args.pp, tp=args.tp, activation_memory_budget=args.activation_memory_budget)
                  for p in args.candidate] or None
    console.print(f"planning {args.model} on {cluster.describe()}, memory limit {size(limit)} per rank ...", soft_wrap=True)
    result = search(args.model, cluster, memory_limit=limit, model_kwargs=_model_kwargs(args), seed=args.seed, candidates=candidates,
                    rows_per_rank=args.rows_per_rank)
    _print(result, args.top)
    if not result.fitting:
        smallest = min(result.over_limit, key=lambda r: r.memory_bytes, default=None)
        need = f"; the smallest plan needs {size(smallest.memory_bytes)} ({smallest.candidate.command_args()})" if smallest else ""
        raise PlanError(f"no plan of the {result.simulated} simulated fits in {size(limit)} per rank{need}")
    best = result.fitting[0]
    console.print(f"chosen: commfx run {args.model} {best.candidate.command_args()}", soft_wrap=True)
    if args.emit:
        with open(args.emit, "w") as f:
            f.write(best.candidate.passes + "\n")
        extra = best.candidate.command_args().split(best.candidate.passes, 1)[1].strip()
        console.print(f"wrote the --passes string to {args.emit}" + (f" (run it with {extra})" if extra else ""), soft_wrap=True)
    return 0


def _print(result, top: int) -> None:
    table = Table(title=f"best {min(top, len(result.fitting))} of {result.simulated} plans simulated (one training step, one rank)")
    for column in ("#", "plan", "step", "vs baseline", "exposed comm", "memory/rank", "why"):
        table.add_column(column, justify="left" if column in ("plan", "why") else "right", overflow="fold")
    base = result.baseline.step_s if result.baseline and result.baseline.prediction else None
    for i, r in enumerate(result.fitting[:top], 1):
        res = r.prediction.result
        table.add_row(str(i), r.candidate.command_args().removeprefix("--passes "), f"{res.step_s * 1e3:.4g} ms",
                      f"{res.step_s / base:.2f}x" if base else "", f"{res.exposed_comm_s * 1e3:.3g} ms", f"{r.memory_bytes / 1e6:.4g} MB", r.why)
    wide.print(table)
    if result.over_limit:
        console.print(f"over the memory limit ({size(result.memory_limit)}): {len(result.over_limit)} plan(s), e.g. "
                      f"{result.over_limit[0].candidate.command_args()} at {size(result.over_limit[0].memory_bytes)}", soft_wrap=True)
    if result.duplicates:
        console.print(f"{result.duplicates} plan(s) predicted exactly as a shorter one (their extra passes change nothing here): not listed")
    reasons: dict[str, list[str]] = {}
    for r in result.refused:
        reasons.setdefault(r.refused, []).append(r.candidate.command_args())
    for why, plans in reasons.items():
        console.print(f"refused ({len(plans)}, e.g. {plans[0]}): {why}", soft_wrap=True)
