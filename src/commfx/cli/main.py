"""`commfx passes | dump | verify | run`: the command line over the Python API."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..plan import COMPUTE_MODES, MACHINE_FIGURES, PRECISIONS, Plan, PlanError
from ..runtime.devices import DEVICES
from .args import ACTIVATION_BUDGET_HELP, budget, non_negative_float, non_negative_int, positive_float, positive_int
from .bench import add_parser as add_bench_parser
from .simulate import add_parser as add_simulate_parser
from .plan import add_parser as add_plan_parser
from .checkpoint_args import add_checkpoint_args, check_checkpoint_args
from .checks import check_local_world, check_output_paths, numbers_as_values, report_defect

# Markup off: what is printed is what was written. Paths, pass lists and error texts hold
# brackets (gloo's `[/path/pair.cc:553]`, `out/[run1]/g.txt`) that rich would read as tags.
# Colour goes through Text.
console = Console(highlight=False, markup=False)
STAGES = ("lifted", "distributed", "forward", "backward")
VERIFY_COMPUTE = (
    "verify checks the rewrite, so its ranks interpret the graphs (--compute interpret) unless --compute or COMMFX_COMPUTE "
    "says otherwise: Inductor's generated kernels differ from eager's in the last bits wherever a model computes in float32 "
    "inside a float64 run (HF's rotary embeddings: torch.compile of the plain float64 Mixtral differs from eager by 3e-8), "
    "which a 1e-10 comparison would blame on the rewrite"
)


def _plan_args(parser: argparse.ArgumentParser, *, default_world: int = 2) -> None:
    parser.add_argument("model", help="built-in name (gpt-moe, gpt-moe-tiny), hf:<model_type>, or path/to/file.py:function")
    parser.add_argument(
        "--passes",
        default="lift,expert_parallel",
        help="comma-separated pass list; options as name:key=value;key=value (default: lift,expert_parallel)",
    )
    parser.add_argument("--world-size", type=positive_int, default=default_world, help="number of ranks")
    parser.add_argument("--ep", type=non_negative_int, default=0, help="expert-parallel size (default: the data-parallel size)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size: stages (use with the pipeline_split pass)")
    parser.add_argument("--ranks-per-node", type=non_negative_int, default=0, help="ranks per node (bytes are split intra/inter node)")
    parser.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel size (needs the tensor_parallel pass; default 1)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32 (default), or bf16: float32 master weights, bfloat16 compute (matmuls, attention, experts; "
        "norms, softmax, router and loss in float32), all-to-alls in bfloat16, gradients reduced in float32",
    )
    parser.add_argument(
        "--grad-reduce", choices=PRECISIONS, default="fp32",
        help="the dtype gradients are all-reduced in: fp32 (default), or bf16 (half the bytes; the result in the parameters' dtype)",
    )
    parser.add_argument(
        "--compute", choices=COMPUTE_MODES, default=None,
        help="inductor (default): the compute between collectives and runtime hooks compiled by Inductor in regions; "
        "interpret: every node run by the graph executor (debugging, bit-for-bit comparisons). Default: $COMMFX_COMPUTE or inductor",
    )
    parser.add_argument("--activation-memory-budget", type=budget, default=None, metavar="B", help=ACTIVATION_BUDGET_HELP)
    parser.add_argument("--batch", type=positive_int, default=None, help="global batch size (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--collective-timeout",
        type=positive_float,
        default=120.0,
        metavar="SECONDS",
        help="bound on every wait inside the ranks: the rendezvous, group creation, each collective (default 120)",
    )


def _plan(args) -> Plan:
    plan = Plan.from_cli(args.passes, world_size=args.world_size, ep=args.ep, pp=args.pp, tp=args.tp, ranks_per_node=args.ranks_per_node)
    plan = dataclasses.replace(plan, collective_timeout_s=args.collective_timeout, precision=args.precision, grad_reduce_dtype=args.grad_reduce,
                               activation_memory_budget=args.activation_memory_budget)
    return dataclasses.replace(plan, compute=args.compute) if args.compute else plan


def cmd_passes(args) -> int:
    from ..passes import REGISTRY

    for name, cls in REGISTRY.items():
        console.print(Text.assemble((f"{name:<18}", "bold"), f" {cls.summary()}"), soft_wrap=True)
    return 0


def cmd_dump(args) -> int:
    from ..compiler.pipeline import compile_program
    from ..models import load_model
    from ..compiler.render import render

    check_output_paths({"--output": args.output})
    plan = _plan(args)
    model, inputs = load_model(args.model, seed=args.seed, **({"batch": args.batch} if args.batch else {}))
    stop = "lift" if args.stage == "lifted" else None
    if args.stage == "lifted" and "lift" not in plan.pass_names():
        raise PlanError("--stage lifted needs lift in --passes")
    if args.diff is not None:
        return _dump_diff(args, plan, model, inputs)
    program = compile_program(model, plan, inputs, stop_after=stop)
    if args.stage in ("forward", "backward"):
        from ..compiler.lower import lower

        lowered = lower(program, inputs, compute=plan.compute, activation_memory_budget=plan.activation_memory_budget)
        gm = lowered.forward if args.stage == "forward" else lowered.backward
    else:
        lowered, gm = None, program.gm
    text = render(gm, args.format)
    if args.stage == "distributed" and program.regions.pipeline is not None:
        from ..compiler.render import render_pipeline

        text = render_pipeline(program.regions.pipeline, args.format)
    notes = list(program.notes)  # what passes chose, and why
    if lowered is not None or plan.activation_memory_budget is not None:
        notes.append(_activation_note(plan, lowered))
    if args.format == "code" and notes:
        text = "".join(f"# {note}\n" for note in notes) + text
    _write(text, args.output, f"{args.stage} graph ({len(gm.graph.nodes)} nodes)")
    return 0


def _activation_note(plan: Plan, lowered) -> str:
    """The dump header's line on activation recomputation: the plan's budget and, for the
    lowered graphs, what the forward saves for the backward."""
    budget = plan.activation_memory_budget
    text = "activation memory budget: " + (f"{budget:g} (the backward recomputes what the forward does not save)" if budget is not None
                                           else "none (the forward saves every activation the backward reads)")
    if lowered is None:
        return text
    from ..compiler.remat import saved_activations

    saved = saved_activations(lowered.forward, lowered.backward)
    return f"{text}; the forward saves {saved.tensors} activations, {saved.bytes:,} bytes at the traced sizes"


def _write(text: str, path: str | None, what: str) -> None:
    """`text` to the file `path` (saying so), or to stdout."""
    if path:
        with open(path, "w") as f:
            f.write(text)
        console.print(f"wrote {what} to {path}")
    else:
        sys.stdout.write(text)


def _dump_diff(args, plan: Plan, model, inputs) -> int:
    """`dump --diff PASS`: the program rendered right before PASS and right after, as a
    unified diff. After pipeline_split the after-render is the stages (as `dump` shows them)."""
    from ..compiler.pipeline import compile_program
    from ..compiler.render import PassSnapshots

    if args.diff not in plan.pass_names():
        raise PlanError(f"--diff {args.diff}: not a pass of this plan; its passes are: {', '.join(plan.pass_names())}")
    if args.stage != "distributed":
        raise PlanError(f"--diff shows the program around one pass; it does not combine with --stage {args.stage}")
    snapshots = PassSnapshots(args.diff, args.format)
    compile_program(model, plan, inputs, stop_after=args.diff, observe=snapshots)
    text = snapshots.diff() or f"# {args.diff} changed nothing in the rendered graph\n"
    _write(text, args.output, f"the diff around {args.diff}")
    return 0


def cmd_verify(args) -> int:
    from ..runtime.devices import check_device
    from ..verify import VerifyCase, verify

    check_local_world(args.world_size, f"--world-size {args.world_size}")
    plan = _plan(args)
    if not args.compute and not os.environ.get("COMMFX_COMPUTE"):
        plan = dataclasses.replace(plan, compute="interpret")  # the rewrite itself, digit for digit (see VERIFY_COMPUTE)
    case = VerifyCase(args.model, plan, batch=args.batch, seed=args.seed)
    mixed = plan.precision != "fp32"
    against = (
        f"a single-process run of the same {plan.precision} recipe (float32 master weights; each tensor's tolerance "
        f"from {plan.precision}'s epsilon and the reduction lengths)"
        if mixed
        else f"a single-process float64 reference (tolerance {args.tolerance:g})"
    )
    check_device(args.device, ranks_per_node=args.world_size)
    transport = "NCCL ranks, one GPU each" if args.device == "cuda" else "gloo ranks"
    console.print(f"verifying {args.model} with passes {args.passes} on {args.world_size} {transport} against {against} ...", soft_wrap=True)
    start = time.perf_counter()
    (report,) = verify([case], args.world_size, tolerance=args.tolerance, timeout_s=args.timeout, device=args.device)
    table = Table(title=f"{args.model}: distributed vs reference (max |difference|)")
    table.add_column("tensor")
    table.add_column("max abs diff", justify="right")
    table.add_column("tolerance", justify="right")
    table.add_row("outputs", f"{report.output_diff:.3e}", f"{report.outputs_tolerance:.3g}")
    for name, diff in sorted(report.grad_diffs.items()):
        marker = " *" if name in report.low_precision else ""
        table.add_row(f"grad {name}{marker}", f"{diff:.3e}", f"{report.tolerance_of(name):.3g}")
    table.add_row("replicated grads across ranks", f"{report.replica_diff:.3e}", f"{args.tolerance:g}")
    console.print(table)
    if mixed:
        console.print(f"* every tensor is judged at {report.tolerance_formula}", soft_wrap=True)
        fp = report.full_precision_diffs
        if fp:
            console.print(
                f"beside it, the float32 model without the {plan.precision} casts differs from this run by {fp['outputs']:.3e} "
                f"in outputs and {fp['grads']:.3e} at most in gradients (the cost of {plan.precision} itself; not judged)",
                soft_wrap=True,
            )
    else:
        for name, (tol, why) in sorted(report.low_precision.items()):
            console.print(f"* grad {name}: judged at {tol:.3g}: {why}", soft_wrap=True)
    for name, found in report.rewrites.items():
        console.print(f"rewrite {name}: " + (", ".join(f"{what} x{n}" for what, n in found.items()) or "nothing (a no-op fails)"), soft_wrap=True)
    console.print(
        f"sequences per rank: {report.rows_per_rank}; tokens per rank: {report.tokens_per_rank}   ({time.perf_counter() - start:.1f}s)"
    )
    for rank in (r for r, rows in enumerate(report.rows_per_rank) if rows == 0):
        console.print(
            f"rank {rank} had no rows (the global batch is smaller than the data-parallel size): it took part in every "
            "collective on a stand-in row, returned empty outputs and contributed zero gradients",
            soft_wrap=True,
        )
    verdict = ("PASS", "green") if report.ok else ("FAIL", "red")
    if report.not_finite:  # the reference is finite (checked before the ranks started): the distributed run made these
        detail = f"not finite: {', '.join(report.not_finite)}, where the single-process reference is finite"
        others = [f for f in report.failures if not f.startswith("not finite")]
        console.print(Text.assemble(verdict, f": {detail}" + (f"; also over tolerance: {', '.join(others)}" if others else "")), soft_wrap=True)
        return 1
    detail = "" if report.ok else f"; over tolerance: {', '.join(report.failures)}"
    judged = "each tensor's tolerance above" if mixed else f"tolerance {args.tolerance:g}"
    console.print(Text.assemble(verdict, f": largest difference {report.max_diff:.3e} ({judged}){detail}"), soft_wrap=True)
    return 0 if report.ok else 1


def memory_summary(memory: list[dict]) -> str:
    """Held bytes per rank (parameters + gradients + optimizer state), as `commfx run` prints them."""
    per_rank = "; ".join(
        f"rank {r}: {m['parameters']:,} + {m['gradients']:,} + {m['optimizer_state']:,} = {m['total']:,}" for r, m in enumerate(memory)
    )
    return f"held bytes (parameters + gradients + optimizer state) after the last step: {per_rank}"


def cmd_run(args) -> int:
    from ..runtime.devices import check_device
    from ..runtime.launcher import launch
    from ..train import TrainConfig

    check_local_world(args.world_size, f"--world-size {args.world_size}")
    check_output_paths({"--dump": args.dump, "--json": args.json, "--trace": args.trace})
    plan = dataclasses.replace(_plan(args), machine=args.machine)
    from ..models import load_model
    from ..verify import preflight

    model, inputs = load_model(args.model, seed=args.seed, **({"batch": args.batch} if args.batch else {}))
    preflight(model, plan, inputs)
    check_checkpoint_args(args, model, plan)
    config = TrainConfig(
        args.model, plan, steps=args.steps, lr=args.lr, seed=args.seed, batch=args.batch, dump_path=args.dump, trace_path=args.trace,
        dtype=args.dtype, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or (args.steps if args.checkpoint_dir else 0),
        resume=args.resume, export_dir=args.export, device=args.device,
    )
    check_device(args.device, ranks_per_node=args.world_size)
    transport = "NCCL ranks, one GPU each" if args.device == "cuda" else "gloo ranks"
    console.print(f"training {args.model} for {args.steps} steps on {args.world_size} local {transport}, passes {args.passes}")
    start = time.perf_counter()
    results = launch(
        "commfx.train:train_worker",
        args.world_size,
        {"config": config},
        timeout_s=args.timeout,
        collective_timeout_s=plan.collective_timeout_s,
        stream_rank0=True,
        device=args.device,
    )
    history = results[0]["history"]
    if not history:
        console.print(f"nothing to train: the checkpoint was saved after step {args.steps} or later (raise --steps)")
        return 0
    console.print(
        f"done in {time.perf_counter() - start:.1f}s: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}; "
        f"parameters per rank {[r['local_params'] for r in results]}"
    )
    console.print(memory_summary([r["memory"] for r in results]))
    if args.dump:
        console.print(f"rewritten graph written to {args.dump}")
    if args.trace:
        from ..runtime.trace import merge_traces

        merged = merge_traces([r["trace"] for r in results], args.trace)
        console.print(f"traces: {merged} (all ranks) and {', '.join(r['trace'] for r in results)}; open in https://ui.perfetto.dev")
    if args.json:
        record = {"history": history, "local_params": [r["local_params"] for r in results], "memory": [r["memory"] for r in results], "expert_placement": results[0]["expert_placement"]}
        try:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
        except OSError as error:  # checked before the ranks started; the path changed since
            raise ValueError(f"--json {args.json}: cannot write there: {error.strerror} (the run itself finished)") from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commfx", description="compile and run distributed training communication")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("passes", help="list the registered passes").set_defaults(func=cmd_passes)

    dump = sub.add_parser("dump", help="print a rewritten graph")
    _plan_args(dump)
    dump.add_argument("--stage", choices=STAGES, default="distributed")
    dump.add_argument("--format", choices=("code", "tabular", "dot"), default="code")
    dump.add_argument("-o", "--output", help="write to this file instead of stdout")
    dump.add_argument("--diff", metavar="PASS", help="show what one pass of the plan changed: the graph before and after it, as a unified diff")
    dump.set_defaults(func=cmd_dump)

    verify = sub.add_parser(
        "verify", help="check the rewrite against a single-process float64 reference (under --precision bf16: the same bf16 recipe)",
        description=VERIFY_COMPUTE,
    )
    _plan_args(verify)
    verify.add_argument("--tolerance", type=non_negative_float, default=1e-10)
    verify.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before the ranks are stopped")
    verify.add_argument("--device", choices=DEVICES, default="cpu", help="cuda: the ranks on GPUs, one each, over NCCL; the reference stays on the CPU")
    verify.set_defaults(func=cmd_verify)

    run = sub.add_parser("run", help="train for a few steps on a local world")
    _plan_args(run, default_world=4)
    run.add_argument("--steps", type=positive_int, default=5)
    run.add_argument("--lr", type=positive_float, default=1e-2)
    run.add_argument("--dump", help="write the rewritten (distributed) graph to this file")
    run.add_argument("--json", help="write the per-step history to this JSON file")
    run.add_argument("--trace", help="write a Chrome/Perfetto timeline here (and one per rank: FILE.rankN.json)")
    run.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before the ranks are stopped")
    run.add_argument("--device", choices=DEVICES, default="cpu", help="cuda: one GPU per rank, NCCL between them (default cpu, gloo)")
    run.add_argument("--machine", choices=MACHINE_FIGURES, default="measure",
                     help="the cost models' figures: measure (default) times the ranks before compiling; given uses the topology's")
    add_checkpoint_args(run)
    run.set_defaults(func=cmd_run)

    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        from ..runtime.launcher import Stopped, stop_on_signals
    except KeyboardInterrupt:  # Ctrl-C while torch is still importing: nothing started yet
        console.print("interrupted (SIGINT) while starting: no rank had started")
        return 128 + 2

    try:
        with stop_on_signals(exit_after_a_stop=True):  # from the start: a signal while compiling, before any rank, ends cleanly too
            return _run_command(argv)
    except Stopped as stop:
        done = "every rank was stopped and the job directory removed" if stop.ranks_stopped else "no rank had started"
        console.print(f"{stop}: {done}")
        return 128 + stop.signum
    except KeyboardInterrupt:
        console.print("interrupted (SIGINT): no rank had started")
        return 128 + 2


def _run_command(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(numbers_as_values(argv))
    from ..compiler.capture import CaptureError
    from ..passes import PassError
    from ..runtime.launcher import LaunchError

    try:
        return args.func(args)
    except (PlanError, CaptureError, PassError, LaunchError, ValueError) as error:  # the user's to fix: one message
        print_error(error)
        return 2
    except Exception as error:  # commfx's own defect
        return report_defect(error, argv, console)


def print_error(error: BaseException) -> None:
    """One line of `error:` and the message as written (the console reads no markup)."""
    console.print(Text.assemble(("error:", "red"), " ", str(error)), soft_wrap=True)
