"""resize_tp: tensor-parallel linears whose contraction width is runtime state.

Every column- and row-parallel linear tensor_parallel made becomes `commfx.tp_linear`,
which computes what the runtime's plan for it says this step (runtime/resize.py): all its
columns (plain tensor parallelism, the default), a kept subset (ZERO-resizing: a slow rank
contracts over fewer columns, dropped ones imputed as zeros in backward, so every
collective keeps its shape), or all but some row-parallel columns a faster rank computes
(lossless migration). The SEMI-migration controller (runtime/semi.py) chooses between them
from all-gathered step timings (ZERO-resizing and SEMI-migration: arXiv 2401.11469).
The graph is the same on every rank and for every width: widths never reach a literal.
"""

from __future__ import annotations

import dataclasses

import torch

from ..compiler.program import Program, stamp
from ..plan import Plan, PlanError
from .base import Pass, PassError, register
from .tensor_parallel import GROUP

commfx = torch.ops.commfx
PASS = "resize_tp"
MODES = ("semi", "resize", "migrate", "off")


@register
class ResizeTP(Pass):
    """Straggler-tolerant tensor parallelism: resize or migrate a slow rank's shard at run time.

    (ZERO-resizing and SEMI-migration, arXiv 2401.11469.)
    """

    name = PASS
    requires = ("tensor parallel",)
    ensures = ("resizable tensor parallel",)
    requires_passes = ("tensor_parallel",)

    @dataclasses.dataclass(frozen=True)
    class Options:
        mode: str = "semi"  # semi: the controller chooses; resize / migrate: only that; off: never act
        window: int = 4  # steps whose timings are averaged before deciding
        threshold: float = 0.15  # a rank this much slower than the median of the others is a straggler
        min_fraction: float = 0.25  # resizing never keeps fewer columns than this fraction
        max_migrate: float = 0.5  # migration never moves more than this fraction of a shard
        heavy_ratio: float = 1.5  # SEMI: slowdown from which persistent slowness is worth migrating
        persist_windows: int = 2  # SEMI: windows in a row that make slowness persistent

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
        if plan.topology.tp < 2:
            raise PlanError("resize_tp balances the ranks of a tensor-parallel group: use --tp 2 or more")

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        blocks = program.annotations.get("tp_blocks") or []
        if not blocks:
            raise PassError("resize_tp found no tensor-parallel block; run tensor_parallel first")
        nodes = {n.name: n for n in program.graph.nodes}
        linears = {}
        for block in blocks:
            for name, kind in [*((c, "column") for c in block["columns"]), (block["row"], "row")]:
                node = nodes[name]
                x, weight = node.args[0], node.args[1]
                bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
                key = weight.target
                if bias is not None and not isinstance(bias, torch.fx.Node):
                    raise PassError(f"resize_tp: {name} has a constant bias {bias!r}; only parameters can be resized")
                node.target = commfx.tp_linear.default
                node.args, node.kwargs = (x, weight, bias, key, GROUP), {}
                stamp(node, PASS, f"{kind}-parallel linear, width set by the runtime")
                linears[key] = {"kind": kind}
        program.annotations["tp_resize"] = {"linears": linears, "options": dataclasses.asdict(options)}
        program.gm.recompile()
        return True
