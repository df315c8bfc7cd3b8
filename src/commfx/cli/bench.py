"""`commfx bench`: time a plan against a baseline on an emulated multi-node cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..plan import COMPUTE_MODES, MACHINE_FIGURES
from .args import ACTIVATION_BUDGET_HELP, budget, non_negative_float, non_negative_int, positive_float, positive_int

__all__ = ["add_parser"]

EXAMPLE = 'commfx bench gpt-moe --passes lift,expert_parallel --vs "" --nodes 2 --ranks-per-node 2 --inter-node 200mbit,1ms'


def add_parser(subparsers) -> None:
    """Register `commfx bench` on the main parser's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="time a plan (and a baseline) on an emulated multi-node cluster",
        description=(
            "Launch NODES x RANKS_PER_NODE ranks, each node a network namespace joined to the others by a "
            "rate/latency-limited link, and measure per step: wall time, compute-only time (collectives "
            "replaced by local copies), communication-only time (the step's collectives replayed alone), "
            "the replay bound max(compute, comm) (a diagnostic), exact bytes per collective, intra/inter node, "
            "the bytes each node's link really carried (its counters) and the wire bound max(compute, busiest "
            "link's bytes / rate + messages x latency). "
            "Falls back to plain localhost (and says so) where namespaces cannot be made (needs root and "
            f"iproute2). Example: {EXAMPLE}"
        ),
    )
    parser.add_argument("model", help="built-in name (gpt-moe, gpt-moe-tiny), hf:<model_type>, or path/to/file.py:function")
    parser.add_argument("--passes", default="lift,expert_parallel", help="the plan under test (default: lift,expert_parallel)")
    parser.add_argument("--vs", metavar="BASELINE_PASSES", default=None,
                        help='baseline plan run in the same invocation, interleaved; "" is plain data parallel')
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=PASSES",
                        help="another plan measured in the same interleaved run (repeatable), "
                             "e.g. --also 'lina=lift,expert_parallel,partition_a2a'")
    parser.add_argument("--flops-per-rank", type=positive_float, default=None,
                        help="compute rate the cost models assume (FLOP/s per rank; see --calibrate)")
    parser.add_argument("--collective-overhead", type=non_negative_float, default=None, metavar="SECONDS",
                        help="fixed cost per collective the cost models assume (default 20e-6; see a --trace)")
    parser.add_argument("--grad-bucket-bytes", type=positive_int, default=None,
                        help="gradient all-reduce bucket size for every plan (default: the plan's, 1 MiB)")
    parser.add_argument("--machine", choices=MACHINE_FIGURES, default=None,
                        help="where the cost models' figures come from: measure (the default, unless --flops-per-rank or "
                             "--collective-overhead is given) times each plan's ranks before it compiles; given uses the topology's")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="every commfx plan's precision: bf16 keeps float32 master weights, computes in bfloat16 and moves "
                             "bfloat16 all-to-all rows (peers run as they are)")
    parser.add_argument("--compute", choices=COMPUTE_MODES, default=None,
                        help="how every commfx plan runs the compute between collectives: inductor (compiled regions) or "
                             "interpret (the graph executor); default: COMMFX_COMPUTE, else inductor (peers run as they are)")
    parser.add_argument("--grad-reduce", choices=("fp32", "bf16"), default="fp32",
                        help="the dtype every commfx plan all-reduces gradients in (default fp32)")
    parser.add_argument("--activation-memory-budget", type=budget, default=None, metavar="B", help=f"every commfx plan's: {ACTIVATION_BUDGET_HELP}")
    parser.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--inter-node", metavar="RATE[,LATENCY]", default="200mbit,1ms",
                        help="per-node inter-node link, tc units, e.g. 1gbit or 200mbit,1ms; 'none' for unlimited "
                             "(default 200mbit,1ms)")
    parser.add_argument("--ep", type=non_negative_int, default=0, help="expert-parallel size (default: the data-parallel size)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (with pipeline_split in --passes)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (with tensor_parallel in --passes)")
    parser.add_argument("--slow-rank", type=_slow_rank, default=None, metavar="R:FACTOR",
                        help="emulate a straggler: rank R computes FACTOR times slower (1:2 is rank 1 at half speed) "
                             "in every plan but the --healthy ones; the output says how (see --slow-method)")
    parser.add_argument("--slow-method", choices=("auto", "cgroup", "delay"), default="auto",
                        help="how the straggler is slowed: a CPU-quota cgroup (needs root), per-op delays in the "
                             "graph executor, or auto (the cgroup where it can be made; default)")
    parser.add_argument("--healthy", action="append", default=[], metavar="LABEL",
                        help="a plan measured without the straggler, e.g. --healthy baseline (repeatable)")
    parser.add_argument("--steps", type=positive_int, default=10, help="measured rounds (default 10)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="rounds run before measuring (default 2)")
    parser.add_argument("--steps-per-round", type=positive_int, default=1,
                        help="training steps per timed round, each phase timed over them and divided (default 1); "
                             "more than 1 shows defer_grad_sync, whose gradient traffic overlaps the next step's forward")
    parser.add_argument("--batch", type=positive_int, default=None, help="global batch size (default: the model's bench preset)")
    parser.add_argument("--batches", choices=("auto", "stream", "fixed"), default="auto",
                        help="what every plan (peers too) trains on: stream, a new global batch every step with token ids from "
                             "Zipf's law over the model's vocabulary (seeded; the next step's batch is given to dm.next_batch); "
                             "fixed, the model's example batch every step; auto (default): stream when a plan has "
                             "split_embedding_comm (its 2d schedule sends the next batch's rows first), else fixed")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="model config override, e.g. --model-arg num_layers=4 (repeatable)")
    parser.add_argument("--proportions", metavar="NAME", default=None,
                        help="gpt-moe scaled down from a real model's config (mixtral-8x7b, qwen3-30b-a3b, olmoe-1b-7b; gpt-2.5b, dense, "
                             "with --pp): the same experts, top-k and width ratios; with --inter-node auto[,LATENCY] the link that "
                             "keeps its compute / all-to-all ratio on 8 x H100 nodes at 400 Gb/s (gpt-2.5b: a stage's compute / "
                             "its boundary send in Optimus-CC's A100 run), from this machine's measured rate or --flops-per-rank")
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--trace", metavar="DIR", help="after measuring, trace one round (--steps-per-round steps) of every plan: DIR/<label>.json "
                                                        "(Chrome/Perfetto, all ranks) and DIR/<label>.rankN.json")
    parser.add_argument("--calibrate", action="store_true",
                        help="first measure compute rate and link throughput, and print the FLOPs-per-byte balance")
    parser.add_argument("--no-emulation", action="store_true", help="run on plain localhost without link shaping")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before the ranks are stopped (default 600)")
    parser.add_argument("--collective-timeout", type=positive_float, default=120.0, metavar="SECONDS",
                        help="bound on every wait inside the ranks: the rendezvous, group creation, each collective (default 120)")
    parser.set_defaults(func=_run)


def _model_kwargs(args) -> dict:
    kwargs = {}
    for item in args.model_arg:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--model-arg {item!r} must be KEY=VALUE, e.g. num_layers=4")
        kwargs[key.strip()] = _number(value.strip())
    if args.batch:
        kwargs["batch"] = args.batch
    return kwargs


def _proportioned(args, inter_node: str):
    """The scaled model and matched link of --proportions, and the --inter-node text to use."""
    from ..bench.proportions import matched_link

    if not args.proportions:
        raise ValueError("--inter-node auto sizes the link for a real model's proportions: add --proportions NAME")
    if args.model != "gpt-moe":
        raise ValueError(f"--proportions scales the built-in gpt-moe; got model {args.model!r} (use gpt-moe)")
    auto = inter_node.lower().startswith("auto")
    flops = args.flops_per_rank or (_measured_flops_per_rank(args) if auto else 1.0)
    matched = matched_link(args.proportions, flops_per_rank=flops, nodes=args.nodes, pp=args.pp)
    return matched, (f"{matched.rate_bits / 1e6:.2f}mbit" + inter_node[4:] if auto else inter_node)


PROPORTIONS_PROBE_REPEATS = 30


def _measured_flops_per_rank(args) -> float:
    """This machine's rate on the scaled model's expert GEMMs, on one rank's share of the cores
    (what `--inter-node auto` sizes the link from when no --flops-per-rank is given)."""
    import os

    import torch

    from ..bench.proportions import bench_model, scaled
    from ..runtime.machine_probe import expert_rate

    model = scaled(bench_model(args.proportions, args.pp))
    world = args.nodes * args.ranks_per_node
    tokens = (args.batch or 32) * 64 // world  # the bench's batch of 64-token sequences, one rank's share
    rows = max(1, tokens * model.top_k // model.experts)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        # The link is sized from this figure, so it is the best of many short timings (some
        # 50 ms in all): on a shared CPU a best of few swings by tens of percent.
        return expert_rate(torch.float32, torch.device("cpu"), model.experts, rows, model.hidden, model.expert_hidden, 3,
                           repeats=PROPORTIONS_PROBE_REPEATS)
    finally:
        torch.set_num_threads(threads)


def _labelled(item: str) -> tuple[str, str]:
    label, eq, passes = item.partition("=")
    if not eq or not label.strip():
        raise ValueError(f"--also {item!r} must be LABEL=PASSES, e.g. lina=lift,expert_parallel,partition_a2a")
    return label.strip(), passes.strip()


def _slow_rank(text: str) -> tuple[int, float]:
    from ..bench.straggler import parse_slow_rank

    try:
        return parse_slow_rank(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--slow-rank ")) from None


def _number(text: str):
    """A --model-arg value: an int, a float, true/false (a config's flags), else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..bench.config import build_config
    from ..bench.harness import run_bench
    from ..bench.render import render
    from ..bench.links import LinkSpec
    from ..bench.proportions import gpt_moe_kwargs
    from ..bench.run_record import TOY, RunRecorder
    from .checks import check_local_world, check_output_paths

    world = args.nodes * args.ranks_per_node
    check_local_world(world, f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node} = {world}")
    check_output_paths({"--json": args.json, "--trace": args.trace}, directories=("--trace",))
    console = Console(highlight=False)
    model_kwargs, inter_node = _model_kwargs(args), args.inter_node.strip()
    if args.proportions or inter_node.lower().startswith("auto"):
        proportioned, inter_node = _proportioned(args, inter_node)
        for line in proportioned.lines():
            console.print(line, markup=False)
        model_kwargs = {**gpt_moe_kwargs(proportioned.model), **model_kwargs}
    link = None if inter_node.lower() == "none" else LinkSpec.parse(inter_node)
    config = build_config(
        args.model, args.passes, args.vs, nodes=args.nodes, ranks_per_node=args.ranks_per_node, ep=args.ep, pp=args.pp,
        model_kwargs=model_kwargs, steps=args.steps, warmup=args.warmup, steps_per_round=args.steps_per_round, lr=args.lr, seed=args.seed,
        also=[_labelled(item) for item in args.also], link=link, flops_per_rank=args.flops_per_rank,
        grad_bucket_bytes=args.grad_bucket_bytes, collective_overhead_s=args.collective_overhead,
        collective_timeout_s=args.collective_timeout, tp=args.tp, slow_rank=args.slow_rank,
        slow_method=args.slow_method, healthy=tuple(args.healthy), batches=args.batches,
        plan_fields={"precision": args.precision, "grad_reduce_dtype": args.grad_reduce, "machine": _machine(args),
                     "activation_memory_budget": args.activation_memory_budget,
                     **({"compute": args.compute} if args.compute else {})},
    )
    if args.trace:
        config = dataclasses.replace(config, trace_dir=str(Path(args.trace).resolve()))
    vs = f" vs {args.vs!r}" if args.vs is not None else ""
    console.print(f"bench {args.model} passes {args.passes!r}{vs}: {args.warmup} warm-up + {args.steps} measured rounds"
                  f"{f' of {args.steps_per_round} steps each' if args.steps_per_round > 1 else ''}, "
                  f"model config {config.model_kwargs}", markup=False)
    recorder = RunRecorder(proportions=args.proportions or TOY)
    result = run_bench(config, link=link, emulate=not args.no_emulation, calibrate_first=args.calibrate,
                       console=console, timeout_s=args.timeout)
    result.run = recorder.finish()
    render(result, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=2, default=str)
        console.print(f"wrote {args.json}", markup=False)
    return 0


def _machine(args) -> str:
    """--machine, or measure unless a figure was given by hand."""
    if args.machine:
        return args.machine
    return "given" if args.flops_per_rank or args.collective_overhead is not None else "measure"
