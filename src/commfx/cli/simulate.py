"""`commfx simulate`: predict a plan's training step on a cluster, without the cluster."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .args import ACTIVATION_BUDGET_HELP, budget, non_negative_int, positive_int

__all__ = ["add_parser"]

console = Console(highlight=False, markup=False)
EXAMPLE = "commfx simulate gpt-moe --passes lift,expert_parallel,partition_a2a --cluster h100 --nodes 2"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="predict a plan's step time, communication and memory on a cluster (event simulation)",
        description=(
            "Compile the plan for one rank, then replay one training step on the cluster's devices and links: "
            "each op's time from a roofline, each collective's from the link model (bandwidth, latency, contention), "
            "ordered by the runtime's priority lanes and chunks. Presets: emulated (this machine's `commfx bench` "
            f"cluster), h100, a100; or --cluster FILE.toml. Example: {EXAMPLE}"
        ),
    )
    parser.add_argument("model", help="built-in name (gpt-moe, gpt-moe-tiny; at `commfx bench`'s preset sizes, as bench runs them), "
                                      "hf:<model_type>, or path/to/file.py:function")
    parser.add_argument("--passes", default="lift,expert_parallel", help="the plan (default: lift,expert_parallel)")
    parser.add_argument("--cluster", default="emulated", metavar="NAME|FILE", help="a preset (emulated, h100, a100) or a TOML file")
    parser.add_argument("--nodes", type=positive_int, default=None, help="nodes (default: the cluster's)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=None, help="ranks per node (default: the cluster's)")
    parser.add_argument("--inter-node", metavar="RATE[,LATENCY]", default=None,
                        help="per-node inter-node link in tc units, as `commfx bench` takes it, e.g. 100mbit or 1gbit,1ms")
    parser.add_argument("--ep", type=non_negative_int, default=0, help="expert-parallel size (default: the data-parallel size)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (with tensor_parallel in --passes)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (with pipeline_split in --passes)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--activation-memory-budget", type=budget, default=None, metavar="B", help=ACTIVATION_BUDGET_HELP)
    parser.add_argument("--batch", type=positive_int, default=None, help="global batch size (default: the model's)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="model config override, e.g. --model-arg num_layers=4 (repeatable)")
    parser.add_argument("--rows-per-rank", type=positive_int, default=None, metavar="N",
                        help="trace one sequence per rank and simulate N (for models too large to trace at their batch here)")
    parser.add_argument("--machine-from", metavar="BENCH_JSON", default=None,
                        help="compile with the cost models' figures a `commfx bench --json` run compiled with (measured on its "
                             "ranks), so automatic choices (partition_a2a k=auto, ...) are the run's; the run's layout and link "
                             "must be this simulation's (default: the cluster's figures)")
    parser.add_argument("--json", metavar="FILE", help="write the prediction here (the step as step_s)")
    parser.add_argument("--trace", metavar="FILE", help="write the simulated step as a Perfetto/Chrome trace (the format of `bench --trace`)")
    parser.add_argument("--validate", metavar="BENCH_JSON", action="append", default=[],
                        help="instead: simulate the commfx plans of a `commfx bench --json` file on its layout and link "
                             "and compare with the measured steps (repeatable)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    import dataclasses

    from ..bench.config import PRESETS
    from ..plan import Plan
    from ..simulate import load_cluster, simulate
    from ..simulate.recorded import machine_from
    from .bench import _model_kwargs
    from .checks import check_output_paths

    check_output_paths({"--json": args.json, "--trace": args.trace})
    cluster = load_cluster(args.cluster).with_layout(args.nodes, args.ranks_per_node, args.inter_node)
    if args.validate:
        return _validate(args, cluster)
    plan = Plan.from_cli(args.passes, world_size=cluster.world_size, ep=args.ep, tp=args.tp, pp=args.pp, ranks_per_node=cluster.ranks_per_node)
    plan = dataclasses.replace(plan, precision=args.precision, activation_memory_budget=args.activation_memory_budget)
    figures, source = None, None
    if args.machine_from:
        figures, source = machine_from(args.machine_from, cluster, args.passes)
    kwargs = {**PRESETS.get(args.model, {}), **_model_kwargs(args)}  # the model `commfx bench MODEL` runs
    prediction = simulate(args.model, plan, cluster, model_kwargs=kwargs, rows_per_rank=args.rows_per_rank, figures=figures)
    if source:
        prediction.notes.append(source)
    record = prediction.as_dict()
    _print(record, cluster)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        console.print(f"wrote {args.json}")
    if args.trace:
        prediction.result.timeline.write(args.trace, prediction.result.history)
        console.print(f"wrote {args.trace}; open in https://ui.perfetto.dev")
    return 0


def _print(record: dict, cluster) -> None:
    console.print(f"{record['model']} with {record['passes']} on {cluster.describe()}", soft_wrap=True)
    table = Table(title="one training step, predicted (one rank)")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("step", f"{record['step_s'] * 1e3:.2f} ms")
    table.add_row("compute", f"{record['compute_s'] * 1e3:.2f} ms")
    table.add_row("communication (any collective in flight)", f"{record['comm_s'] * 1e3:.2f} ms")
    table.add_row("exposed communication (compute waiting)", f"{record['exposed_comm_s'] * 1e3:.2f} ms")
    table.add_row("collectives", str(record["collectives_per_rank"]))
    use = record["link_utilisation"]
    table.add_row("inter-node link: bytes per node / utilisation", f"{record['inter_node_bytes_per_node'] / 1e6:.3g} MB / {use['inter_node']:.0%}")
    table.add_row("intra-node: bytes per rank / utilisation", f"{record['intra_node_bytes_per_rank'] / 1e6:.3g} MB / {use['intra_node']:.0%}")
    if record.get("pipeline_boundary_bytes_per_step"):
        table.add_row("pipeline boundaries: bytes per step, both ways", f"{record['pipeline_boundary_bytes_per_step'] / 1e6:.3g} MB")
    memory = record["peak_memory_bytes_per_rank"]
    table.add_row("peak memory per rank", f"{memory['total'] / 1e6:.4g} MB")
    table.add_row("  parameters + gradients + optimizer", f"{(memory['parameters'] + memory['gradients'] + memory['optimizer_state']) / 1e6:.4g} MB")
    table.add_row("  activations kept for backward", f"{memory['activations'] / 1e6:.4g} MB")
    console.print(table)
    for note in record["notes"]:
        console.print(f"note: {note}", soft_wrap=True)


def _validate(args, cluster) -> int:
    """Every commfx plan of each bench JSON predicted against its measured step; 1 when the
    simulator's automatic choices for a plan differ from the run's (the message says which)."""
    from ..simulate.validate import ChoiceMismatch, validate

    rows, status = [], 0
    for path in args.validate:
        try:
            comparisons, skipped = validate(path, cluster)
        except ChoiceMismatch as error:
            console.print(f"error: {error}", soft_wrap=True)
            status = 1
            continue
        fitted = any(c.fitted for c in comparisons)
        title = f"{path}: predicted vs measured step (median)" + (f" — in-sample: the {cluster.name} cluster was fitted to this run" if fitted else "")
        table = Table(title=title)
        for column in ("plan", "measured", "predicted", "error", "ratio measured", "ratio predicted", "ratio error", "automatic choices"):
            table.add_column(column, justify="left" if column in ("plan", "automatic choices") else "right")
        for c in comparisons:
            chosen = ", ".join(f"{k}={v}" + (" (not recorded by the run)" if k in c.unchecked else "") for k, v in c.choices.items())
            table.add_row(c.label, f"{c.measured_s * 1e3:.1f} ms", f"{c.predicted_s * 1e3:.1f} ms", f"{c.step_error:+.1%}",
                          f"{c.measured_ratio:.3f}", f"{c.predicted_ratio:.3f}", f"{c.ratio_error:+.1%}", chosen or "-")
            rows.append({"json": str(path), **c.as_dict()})
        console.print(table)
        for source in sorted({c.figures for c in comparisons}):
            console.print(f"cost models' figures: {source}", soft_wrap=True)
        for why in skipped:
            console.print(f"skipped: {why}", soft_wrap=True)
    if rows:
        errors = sorted(abs(r["step_error"]) for r in rows)
        console.print(f"step error over {len(rows)} plans: median {errors[len(errors) // 2]:.1%}, worst {errors[-1]:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return status
