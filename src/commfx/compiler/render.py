"""One renderer for `commfx dump` and the golden snapshots.

Output is normalised so it is stable run to run and machine to machine: no stack traces or
addresses, symbolic sizes renamed in order of appearance (s0, s1, ... -> B, U0, U1 ...),
process groups shown by their plan name. Each node that a pass made carries a comment
naming that pass and why.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from .compile_regions import REGION

FORMATS = ("code", "tabular", "dot")


def render(gm: fx.GraphModule, fmt: str = "code") -> str:
    return _normalise_symbols(_render_raw(gm, fmt))


def render_pipeline(pipeline, fmt: str = "code") -> str:
    """A split program (compiler.stages.Pipeline): its stages and boundaries, then each
    stage's graph; sizes share one naming across the whole text."""
    parts = [pipeline.describe()]
    for stage in pipeline.stages:
        parts.append(f"\n# ---- stage {stage.index} ----\n{_render_raw(stage.gm, fmt)}")
    return _normalise_symbols("".join(parts))


def render_program(program, fmt: str = "code") -> str:
    """A program as `commfx dump` shows it: its graph, or its stages once pipeline_split ran."""
    pipeline = program.regions.pipeline
    return render_pipeline(pipeline, fmt) if pipeline is not None else render(program.gm, fmt)


class PassSnapshots:
    """An observer for `run_passes`: renders the program right before and right after one
    pass (text only; no graph is copied), for `commfx dump --diff PASS`."""

    def __init__(self, pass_name: str, fmt: str = "code"):
        self.pass_name, self.fmt = pass_name, fmt
        self.before: str | None = None
        self.after: str | None = None

    def __call__(self, when: str, pass_name: str, program) -> None:
        if pass_name == self.pass_name:
            setattr(self, when, render_program(program, self.fmt))

    def diff(self) -> str:
        """The unified diff of the two renders ('' when the pass changed nothing shown)."""
        import difflib

        lines = difflib.unified_diff(
            (self.before or "").splitlines(keepends=True),
            (self.after or "").splitlines(keepends=True),
            fromfile=f"before {self.pass_name}",
            tofile=f"after {self.pass_name}",
        )
        return "".join(lines)


def _render_raw(gm: fx.GraphModule, fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    rows = [_row(node) for node in gm.graph.nodes]
    return {"code": _as_code, "tabular": _as_table, "dot": _as_dot}[fmt](rows)


def _row(node: fx.Node) -> dict:
    provenance = node.meta.get("commfx")
    return {
        "name": node.name,
        "op": node.op,
        "target": _target(node),
        "args": ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]),
        "type": _type(node),
        "provenance": f"{provenance['pass']}: {provenance['purpose']}" if provenance else "",
        "inputs": [n.name for n in node.all_input_nodes],
        "region": node.meta.get(REGION),
    }


def _target(node: fx.Node) -> str:
    target = node.target
    if node.op in ("placeholder", "get_attr", "output", "call_module"):
        return str(target)
    if node.op == "call_method":
        return f".{target}"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}" + ("" if target._overloadname == "default" else f".{target._overloadname}")
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", str(target))
    module = {"_operator": "operator", "torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch"}.get(module, module)
    return f"{module}.{name}" if module else name


def _arg(value) -> str:
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _type(node: fx.Node) -> str:
    value = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "(" + ", ".join(f"{str(v.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in v.shape)}]" for v in value) + ")"
    return ""


def _as_code(rows: list[dict]) -> str:
    lines = []
    sizes: dict[int, int] = {}
    for r in rows:
        if r["region"] is not None:
            sizes[r["region"]] = sizes.get(r["region"], 0) + 1
    previous = None
    for r in rows:
        if r["region"] != previous and r["region"] is not None:
            lines.append(f"# ---- region {r['region']} ({sizes[r['region']]} nodes, compiled by Inductor) ----")
        elif r["region"] != previous:
            lines.append("# ---- interpreted ----")
        previous = r["region"]
        if r["op"] == "placeholder":
            line = f"%{r['name']} = input {r['target']}"
        elif r["op"] == "get_attr":
            line = f"%{r['name']} = param {r['target']}"
        elif r["op"] == "output":
            line = f"return {r['args']}"
        else:
            line = f"%{r['name']} = {r['target']}({r['args']})"
        if r["type"]:
            line += f"  : {r['type']}"
        if r["provenance"]:
            line += f"  # [{r['provenance']}]"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _as_table(rows: list[dict]) -> str:
    header = ("name", "op", "target", "type", "made by")
    table = [header] + [(r["name"], r["op"], r["target"], r["type"], r["provenance"]) for r in rows]
    if any(r["region"] is not None for r in rows):  # a lowered graph cut into compiled regions
        header = (*header, "region")
        table = [header] + [(*row, "" if r["region"] is None else str(r["region"])) for row, r in zip(table[1:], rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table) + "\n"


def _as_dot(rows: list[dict]) -> str:
    lines = ["digraph commfx {", "  node [shape=box, fontname=monospace];"]
    for r in rows:
        color = ', style=filled, fillcolor="#ffe0b0"' if r["provenance"] else ""
        label = f"{r['name']}\\n{r['target']}" + (f"\\n[{r['provenance']}]" if r["provenance"] else "")
        lines.append(f'  "{r["name"]}" [label="{label}"{color}];')
        lines.extend(f'  "{i}" -> "{r["name"]}";' for i in r["inputs"])
    lines.append("}")
    return "\n".join(lines) + "\n"


def _normalise_symbols(text: str) -> str:
    """Rename shape symbols in order of first appearance so snapshots do not churn."""
    mapping: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        symbol = match.group(0)
        if symbol not in mapping:
            prefix = "u" if symbol.startswith("u") else "s"
            mapping[symbol] = f"{prefix.upper()}{sum(1 for v in mapping.values() if v[0] == prefix.upper())}"
        return mapping[symbol]

    return re.sub(r"\b[su]\d+\b", rename, text)
