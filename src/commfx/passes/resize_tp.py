"""resize_tp: tensor-parallel linears whose contraction width is runtime state.

Every column- and row-parallel linear tensor_parallel made becomes `commfx.tp_linear`,
which computes what the runtime's plan for it says this step (runtime/resize/): all its
columns (plain tensor parallelism, the default), a kept subset (ZERO-resizing: a slow rank
contracts over fewer columns, dropped ones imputed as zeros in backward, so every
collective keeps its shape), or all but the units a faster rank computes (lossless
migration). For unit migration (`migrate=units`, the default where the tp group is the whole
replica) each block's row-parallel output also passes through `commfx.tp_units`, which on
a taker adds the partial products of the units it computes for a slower rank, each from
the block's replicated input with the tensor_parallel pass's unit function (an attention
head, or a block of MLP columns, end to end). `migrate=columns` moves row-
parallel columns whose input the straggler sends every step; it is the migration for tp x dp.
The SEMI-migration controller (runtime/semi.py) chooses between resizing and migrating
from all-gathered step timings (ZERO-resizing and SEMI-migration: arXiv 2401.11469).
The graph is the same on every rank and for every width: widths never reach a literal.
"""

from __future__ import annotations

import dataclasses

import torch

from ..compiler.program import Program, stamp
from ..compiler.regions import TPBlock
from ..compiler.rewrite import Rewriter
from ..plan import Plan, PlanError
from .base import DEFERRED, Pass, PassError, register
from .defer_grad_sync import REFUSED as DEFER_REFUSED
from .tensor_parallel import GROUP

commfx = torch.ops.commfx
PASS = "resize_tp"
MODES = ("semi", "resize", "migrate", "off")
MIGRATIONS = ("auto", "units", "columns")


PIPELINE_REFUSED = "its straggler controller runs in the whole-model runtime, not inside pipeline stages; use resize_tp with --pp 1"


@register(PASS, requires="tensor parallel", ensures="resizable tensor parallel",
          refuses={**Pass.refuses, DEFERRED: DEFER_REFUSED["resizable tensor parallel"], "pipeline split": PIPELINE_REFUSED})
class ResizeTP(Pass):
    """Straggler-tolerant tensor parallelism: resize or migrate a slow rank's shard at run time.

    (ZERO-resizing and SEMI-migration, arXiv 2401.11469.)
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        mode: str = "semi"  # semi: the controller chooses; resize / migrate: only that; off: never act
        window: int = 4  # steps whose timings are averaged before deciding
        threshold: float = 0.15  # a rank this much slower than the median of the others is a straggler
        min_fraction: float = 0.25  # resizing never keeps fewer columns than this fraction
        max_migrate: float = 0.75  # migration never moves more than this fraction of a shard (its units, or its row-parallel columns)
        heavy_ratio: float = 1.5  # SEMI: slowdown from which persistent slowness is worth migrating
        persist_windows: int = 2  # SEMI: windows in a row that make slowness persistent
        migrate: str = "auto"  # units: whole heads / MLP column blocks, moved once; columns: row-parallel columns sent every step; auto: units where dp = pp = 1
        tolerance: float = 0.05  # SEMI with units: where lossless migration leaves a step over (1 + tolerance) x the others', resize the rest (inf: lossless only)

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.mode not in MODES:
            raise PlanError(f"resize_tp mode must be one of {', '.join(MODES)}, got {options.mode!r}")
        if not 0.0 < options.min_fraction <= 1.0:
            raise PlanError(
                f"resize_tp min_fraction={options.min_fraction} is out of range: a rank keeps a fraction in (0, 1] "
                "of its columns, e.g. min_fraction=0.25"
            )
        if not 0.0 <= options.max_migrate < 1.0:
            raise PlanError(f"resize_tp max_migrate={options.max_migrate} is out of range: use a fraction in [0, 1), e.g. 0.5")
        if options.window < 1 or options.persist_windows < 1 or options.threshold <= 0 or options.heavy_ratio < 1:
            raise PlanError(
                f"resize_tp needs window >= 1, persist_windows >= 1, threshold > 0 and heavy_ratio >= 1; got window={options.window}, "
                f"persist_windows={options.persist_windows}, threshold={options.threshold}, heavy_ratio={options.heavy_ratio}"
            )
        if not options.tolerance >= 0.0:
            raise PlanError(f"resize_tp tolerance={options.tolerance} must be >= 0 (the step SEMI aims at over the others'; inf: lossless only)")
        if plan.topology.tp < 2:
            raise PlanError("resize_tp balances the ranks of a tensor-parallel group: use --tp 2 or more")
        if options.migrate not in MIGRATIONS:
            raise PlanError(f"resize_tp migrate must be one of {', '.join(MIGRATIONS)}, got {options.migrate!r}")
        if options.migrate == "units" and (plan.topology.dp > 1 or plan.topology.pp > 1):
            raise PlanError(
                f"resize_tp migrate=units needs the tp group to be the whole replica (dp = pp = 1, got dp={plan.topology.dp}, "
                f"pp={plan.topology.pp}): each tp group decides alone, so replicas could move different units; use migrate=columns"
            )

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        blocks = program.regions.tp_blocks
        if not blocks:
            raise PassError("resize_tp found no tensor-parallel block; run tensor_parallel first")
        rw = Rewriter(program, PASS)
        linears = {}
        for block in blocks:
            for node, kind in [*((c, "column") for c in block.columns), (block.row, "row")]:
                x, weight = node.args[0], node.args[1]
                bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
                key = weight.target
                if bias is not None and not isinstance(bias, torch.fx.Node):
                    raise PassError(f"resize_tp: {node.name} has a constant bias {bias!r}; only parameters can be resized")
                node.target = commfx.tp_linear.default
                node.args, node.kwargs = (x, weight, bias, key, GROUP), {}
                stamp(node, PASS, f"{kind}-parallel linear, width set by the runtime")
                linears[key] = {"kind": kind}
        migrate = options.migrate
        if migrate == "auto":
            migrate = "units" if plan.topology.dp == 1 and plan.topology.pp == 1 else "columns"
        units = _insert_units(rw, blocks) if migrate == "units" else {}
        program.runtime.tp_resize = {
            "linears": linears, "options": {**dataclasses.asdict(options), "migrate": migrate}, "units": units,
        }
        program.notes.append(_note(options, migrate, len(linears), units))
        rw.finish()
        return True


def _note(options: ResizeTP.Options, migrate: str, linears: int, units: dict) -> str:
    """What `commfx dump` says the controller will do, with its options."""
    what = (f"whole units of {len(units)} block(s) ({', '.join(sorted(u['path'] for u in units.values()))}): heads / MLP column "
            "blocks, resized on views and migrated once per decision" if migrate == "units" and units
            else "contraction columns (resized by gather, row-parallel columns migrated every step)")
    semi = (f"SEMI aims at (1 + tolerance {options.tolerance:g}) x the others' step, migrating what fits and resizing the rest"
            if migrate == "units" else "SEMI migrates heavy persistent slowness and resizes what migration cannot balance")
    return (f"{PASS}: {linears} tp linears; a rank {options.threshold:.0%} slower than the others over {options.window} steps is a "
            f"straggler (mode={options.mode}); it moves {what}; {semi}; it keeps at least min_fraction={options.min_fraction:g} "
            f"and gives at most max_migrate={options.max_migrate:g}")


def _insert_units(rw: Rewriter, blocks: list[TPBlock]) -> dict:
    """Route each block's row-parallel partial product through `commfx.tp_units` (before the
    all-reduce), fed with the outside inputs of the block's unit function."""
    units = {}
    for block in blocks:
        function = block.unit_function
        if function is None:
            continue  # the shard rules cannot cut this block into units: it only resizes
        row = block.row
        key = row.args[1].target
        externals = block.unit_inputs
        kinds = "".join("t" if isinstance(e.meta.get("example_value"), torch.Tensor) else "s" for e in externals)
        tensors = [e for e, k in zip(externals, kinds) if k == "t"]
        sizes = [e for e, k in zip(externals, kinds) if k == "s"]
        users = list(row.users)
        with rw.after(row):
            out = rw.call(commfx.tp_units.default, (row, tensors, sizes, key, GROUP), like=row, keep=("example_value", "val"),
                          purpose="adds the partial products of units this rank computes for a slower one")
        for user in users:
            user.replace_input_with(row, out)
        # the unit function takes each column's weight then its bias, then the row weight
        ordered = []
        for c in function["columns"]:
            ordered.append((c["weight"], 0, c["layout"]))
            if c["bias"] is not None:
                ordered.append((c["bias"], 0, c["layout"]))
        ordered.append((function["row"]["weight"], 1, function["row"]["layout"]))
        units[key] = {"path": block.path, "graph": function["graph"], "kinds": kinds, "tensors": ordered,
                      "per_rank": function["per_rank"], "unit": function["unit"]}
    return units
