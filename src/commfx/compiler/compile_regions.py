"""Compiled regions: the compute between collectives and runtime hooks, compiled by Inductor.

A lowered graph (forward or backward, after the schedule passes) is cut into regions:
maximal runs of compute nodes, in graph order, that contain no collective (the ops
`runtime.executor.COMM_OPS` names, which communicate) and cross no point where the runtime
acts (`Hooks`: a region starts at `before` nodes, a deferred parameter's first use or a
ZeRO-3 bucket's first reader, and ends at `after` nodes, a gradient bucket's last gradient
or a bucket's last reader). Each region becomes a submodule of the graph (`region_<i>`)
called by one `call_module` node whose outputs the rest of the graph reads through
`getitem`, so the executor still sees every collective, every gradient output and every
parameter read as a node of the outer graph. The submodule runs the region's code
compiled by Inductor (C++ on CPUs, Triton on GPUs) on the region's own FX graph, traced
again with Inductor's decompositions; a region Inductor cannot compile stays interpreted
(its nodes are left in the outer graph) and the graph keeps a one-line note saying why.

The collectives stay in the outer graph, so Inductor never merges compute across them
and the overlap the schedule passes built (an all-to-all started early, waited late) is
kept. Inductor's FX graph cache is on (its default), so a second run of the same model
compiles from the cache (`TORCHINDUCTOR_CACHE_DIR`, default under the system's temp dir).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx as fx

from ..runtime.executor import REGION_REPORT, is_collective

_log = logging.getLogger(__name__)
REGION = "commfx_region"  # node.meta: the index of the region a node belongs to (set by cut_regions)
_OUTSIDE = {"placeholder", "output", "get_attr"}
# Ops that only reshape or read sizes: a run of them alone is not worth a compiled call.
_TRIVIAL = {"sym_size", "view", "_unsafe_view", "t", "transpose", "detach", "alias", "expand", "unsqueeze", "squeeze", "permute", "reshape", "slice", "select", "split", "unbind"}


@dataclass
class Hooks:
    """Where the runtime acts inside one graph: a region starts at each node of `before`
    and ends right after each node of `after`."""

    before: set[fx.Node] = field(default_factory=set)
    after: set[fx.Node] = field(default_factory=set)


# (graph, phase "forward"|"backward") -> the runtime's hooks in that graph as (before, after)
# sets of nodes (plain sets: the runtime, which names them, does not import the compiler)
HookPoints = Callable[[fx.GraphModule, str], tuple]


@dataclass
class RegionReport:
    """What compile_regions did to one graph: regions compiled, nodes each, notes, seconds."""

    sizes: list[int] = field(default_factory=list)
    interpreted: int = 0  # regions left interpreted (trivial or not compilable)
    failed_nodes: int = 0  # nodes of the regions Inductor could not compile (see notes)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def default_hooks(gm: fx.GraphModule, phase: str) -> Hooks:
    """Hooks when the runtime names none: in backward every gradient output ends a region
    (so each gradient reaches the sync as soon as it exists, as when interpreted)."""
    if phase != "backward":
        return Hooks()
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return Hooks(after={v for v in output.args[0] if isinstance(v, fx.Node)})


def cut_regions(gm: fx.GraphModule, hooks: Hooks | None = None) -> list[list[fx.Node]]:
    """The graph's regions in order (lists of nodes), each marked in node.meta[REGION].
    Collectives, placeholders, the output, and getitems of nodes outside the region stay out."""
    hooks = hooks or Hooks()
    _hoist_getitems(gm)
    regions: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    ending = False  # a hook's `after` node was added: close once its getitems are in

    def close():
        if current:
            regions.append(list(current))
            current.clear()

    for node in gm.graph.nodes:
        node.meta.pop(REGION, None)
        inner_read = node.target is operator.getitem and node.args[0] in current
        if ending and not inner_read:
            close()
        ending = ending and inner_read
        if node.op in _OUTSIDE or is_collective(node):
            close()
            continue
        if node.target is operator.getitem and not inner_read:
            close()  # a getitem of a collective's (or an earlier region's) tuple: read outside
            continue
        if node in hooks.before:
            close()
        current.append(node)
        if node in hooks.after:
            ending = True
    close()
    for index, region in enumerate(regions):
        for node in region:
            node.meta[REGION] = index
    return regions


def mark_regions(gm: fx.GraphModule, hooks: Hooks | None = None) -> list[list[fx.Node]]:
    """The regions compile_regions would compile (trivial runs unmarked), without compiling:
    what `commfx dump --stage forward|backward` shows under compute="inductor"."""
    regions = [r for r in cut_regions(gm, hooks) if _worth_compiling(r) or _unmark(r)]
    for index, region in enumerate(regions):
        for node in region:
            node.meta[REGION] = index
    return regions


def _unmark(nodes: list[fx.Node]) -> bool:
    for node in nodes:
        node.meta.pop(REGION, None)
    return False


def _hoist_getitems(gm: fx.GraphModule) -> None:
    """Move each getitem right after the node whose tuple it reads, so a region never
    hands a tuple to the outer graph (only tensors and sizes)."""
    for node in list(gm.graph.nodes):
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            source = node.args[0]
            anchor = source
            while anchor.next.target is operator.getitem and anchor.next.args[0] is source and anchor.next is not node:
                anchor = anchor.next
            if anchor.next is not node:
                anchor.append(node)


def compile_regions(gm: fx.GraphModule, phase: str, hooks: Hooks | None = None, *, is_backward: bool | None = None) -> RegionReport:
    """Cut `gm` into regions and replace each with a call of its Inductor-compiled code (in
    place). Runs in the lowering's tracing context (node.meta["val"] are its fakes), or in
    one made for the graph's fake mode when called on a lowered graph afterwards."""
    start = time.perf_counter()
    report = RegionReport()
    regions = cut_regions(gm, hooks if hooks is not None else default_hooks(gm, phase))
    with _tracing_context(gm):
        _compile_each(gm, regions, phase, report, phase == "backward" if is_backward is None else is_backward)
    gm.graph.lint()
    gm.recompile()
    for key in ("commfx_first_uses", "commfx_param_uses"):  # caches keyed by the graph's old nodes
        gm.meta.pop(key, None)
    report.seconds = time.perf_counter() - start
    gm.meta[REGION_REPORT] = report
    for note in report.notes:
        print(f"commfx: {phase} graph: {note}", file=sys.stderr, flush=True)
    return report


def _tracing_context(gm: fx.GraphModule):
    if torch._guards.TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = torch._guards.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    return torch._guards.tracing(torch._guards.TracingContext(mode)) if mode is not None else contextlib.nullcontext()


def _compile_each(gm: fx.GraphModule, regions: list[list[fx.Node]], phase: str, report: RegionReport, is_backward: bool) -> None:
    for index, nodes in enumerate(regions):
        if not _worth_compiling(nodes):
            report.interpreted += 1
            continue
        inputs, outputs = _boundary(nodes)
        inputs += _size_inputs(gm, nodes, inputs)
        try:
            module = _compile_region(nodes, inputs, outputs, is_backward)
        except Exception as error:  # noqa: BLE001  (any Inductor failure: the region stays interpreted)
            report.interpreted += 1
            report.failed_nodes += len(nodes)
            _log.debug("region %d of the %s graph stays interpreted", index, phase, exc_info=True)
            report.notes.append(f"region {index} ({len(nodes)} nodes) stays interpreted: {type(error).__name__}: {_first_line(error)}")
            continue
        _replace(gm, nodes, inputs, outputs, f"region_{index}", module)
        report.sizes.append(len(nodes))


class CompiledRegion(torch.nn.Module):
    """One region: its FX graph (`graph_module`, for dumps and debugging) and the compiled
    callable that runs it (Inductor's boxed calling convention: one list of inputs)."""

    def __init__(self, graph_module: fx.GraphModule, compiled: Callable):
        super().__init__()
        self.graph_module = graph_module
        self.compiled = compiled

    def forward(self, *args):
        return tuple(self.compiled(list(args)))


def _worth_compiling(nodes: list[fx.Node]) -> bool:
    return any(n.op == "call_function" and n.target is not operator.getitem and _name(n.target) not in _TRIVIAL and not isinstance(n.meta.get("val"), torch.SymInt) for n in nodes)


def _name(target) -> str:
    return getattr(target, "_opname", getattr(target, "__name__", ""))


def _boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs: values the region reads from outside, outputs: its values read outside)."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for source in node.all_input_nodes:
            if source not in inside and source not in inputs:
                inputs.append(source)
    outputs = [n for n in nodes if any(user not in inside for user in n.users)]
    return inputs, outputs


def _size_inputs(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node]) -> list[fx.Node]:
    """Nodes of the outer graph to pass a region as well, for each symbol its inputs' sizes use
    (`s0*s1` uses both) that no input has as a plain size of its own: a size node (placeholder,
    sym_size) or a tensor with that size. Inductor's code binds every symbol from an input."""
    bound, used = set(), set()
    for source in inputs:
        for size in _sizes(source.meta.get("val")):
            used |= size.node.expr.free_symbols
            if size.node.expr.is_Symbol:
                bound.add(size.node.expr)
    missing = used - bound
    if not missing:
        return []
    extra = []
    for node in gm.graph.nodes:
        if node is nodes[0]:
            break
        value = node.meta.get("val")
        plain = {d.node.expr for d in _sizes(value) if d.node.expr.is_Symbol} & missing
        if plain:  # a size, or a tensor with the symbol as one of its sizes (Inductor reads it there)
            missing -= plain
            extra.append(node)
    return extra


def _sizes(value) -> list[torch.SymInt]:
    if isinstance(value, torch.SymInt):
        return [value]
    if isinstance(value, torch.Tensor):
        return [d for d in (*value.shape, *value.stride()) if isinstance(d, torch.SymInt)]
    return []


def _compile_region(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node], is_backward: bool) -> CompiledRegion:
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    region = _region_module(nodes, inputs, outputs)
    examples = [source.meta["val"] for source in inputs]
    mode = torch._guards.detect_fake_mode(examples)
    examples = _plain_sums(examples, mode)
    # The region's structure and inputs decide its decomposition, so a region of the same
    # structure as one compiled before (the next layer's) reuses its code before tracing.
    key = _reuse_key(region, examples, is_backward, mode)
    if key is not None and key in _COMPILED:
        return CompiledRegion(region, _COMPILED[key])
    with mode if mode is not None else contextlib.nullcontext():  # factory ops (arange of a size) trace on fakes too
        decomposed = make_fx(region, decomposition_table=select_decomp_table(), tracing_mode="real")(*examples)
    if any(node.op == "get_attr" for node in decomposed.graph.nodes):
        key = None  # the decomposition made constants, whose values the region's code does not show
    context = torch._guards.TracingContext.try_get()
    strides = context.output_strides if context is not None else None
    if context is not None:  # Inductor records a graph's output strides there: they are the region's, not the lowered graph's
        context.output_strides = None
    try:
        try:
            compiled = compile_fx_inner(decomposed, examples, is_backward=is_backward, is_inference=False)
        except NameError:  # torch's FX graph cache can fail to evaluate a cached entry's size guards: compile afresh
            with torch._inductor.config.patch(fx_graph_cache=False):
                compiled = compile_fx_inner(decomposed, examples, is_backward=is_backward, is_inference=False)
    finally:
        if context is not None:
            context.output_strides = strides
    if key is not None:
        _COMPILED[key] = compiled
    return CompiledRegion(region, compiled)


def _region_module(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """`nodes` as a graph of their own, taking `inputs` (named by position) and returning `outputs`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for position, source in enumerate(inputs):
        placeholder = graph.placeholder(f"input_{position}")
        placeholder.meta.update(source.meta)
        env[source] = placeholder
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _structure(region: fx.GraphModule) -> tuple[str, ...]:
    """The region's code without its node names (each layer's copy of a region names its
    nodes apart): every node's op, target and arguments, nodes given by position."""
    position = {node: index for index, node in enumerate(region.graph.nodes)}
    return tuple(f"{node.op} {node.target} {fx.map_arg((node.args, node.kwargs), lambda n: f'%{position[n]}')}"
                 for node in region.graph.nodes)


# Regions compiled in this process, by what their compiled code depends on (`_reuse_key`).
# The layers of a model give regions of the same code whose sizes differ only in the names
# of their data-dependent symbols (u14 in one layer, u26 in the next), which Inductor's FX
# graph cache keys apart: a model of L layers would compile each region L times.
_COMPILED: dict[tuple, Callable] = {}


def _reuse_key(region: fx.GraphModule, examples: list, is_backward: bool, mode) -> tuple | None:
    """What a region's compiled code depends on: its graph's structure (its decomposition
    follows from it and the inputs), each input's kind, dtype, device, sizes and strides
    with symbols renamed by first appearance, those symbols' value ranges and the runtime
    asserts on them, and Inductor's configuration. None (compile it) when the graph holds
    constants, whose values the code does not show."""
    if any(node.op == "get_attr" for node in region.graph.nodes):
        return None
    names: dict = {}

    def canonical(size) -> str:
        expr = size.node.expr if isinstance(size, torch.SymInt) else size
        if not hasattr(expr, "free_symbols"):
            return str(expr)
        for symbol in sorted(expr.free_symbols, key=str):
            names.setdefault(symbol, sympy.Symbol(f"c{len(names)}", integer=True))
        return str(expr.xreplace(names))

    signature = []
    for example in examples:
        if isinstance(example, torch.Tensor):
            signature.append((example.dtype, example.device.type, tuple(map(canonical, example.shape)), tuple(map(canonical, example.stride())), example.requires_grad))
        else:
            signature.append((type(example).__name__, canonical(example)))
    shape_env = getattr(mode, "shape_env", None)
    facts: list = []
    if shape_env is not None:
        for symbol, name in names.items():
            value_range = shape_env.var_to_range.get(symbol)
            facts.append((str(name), str(value_range)))
            for runtime_assert in shape_env.deferred_runtime_asserts.get(symbol, ()):
                if runtime_assert.expr.free_symbols <= names.keys():
                    facts.append(str(runtime_assert.expr.xreplace(names)))
    return (_structure(region), tuple(signature), tuple(facts), is_backward, torch._inductor.config.get_hash())


def _plain_sums(examples: list, mode) -> list:
    """The region's example inputs with each sum of symbols that no input binds alone (the
    size of partition_a2a's merged chunks in backward: u0 + u1, with u0 and u1 nowhere) made
    one fresh symbol: Inductor binds a symbol only from an input's plain size, and the region
    needs just the sum, which the input's real size gives at run time."""
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is None:
        return examples
    bound = {d.node.expr for value in examples for d in _sizes(value) if d.node.expr.is_Symbol}
    fresh = {}
    for value in examples:
        for d in _sizes(value):
            expr = d.node.expr
            if not expr.is_Symbol and not expr.free_symbols <= bound and expr not in fresh:
                with shape_env.ignore_fresh_unbacked_symbols():  # bound by the region's input, not by an op
                    fresh[expr] = shape_env.create_unbacked_symint().node.expr
    if not fresh:
        return examples

    def plain(d):
        if not isinstance(d, torch.SymInt):
            return d
        expr = d.node.expr.xreplace(fresh)
        return d if expr == d.node.expr else shape_env.create_symintnode(expr, hint=None)

    remade = []
    for value in examples:
        if isinstance(value, torch.SymInt):
            value = plain(value)
        elif isinstance(value, torch.Tensor) and any(d.node.expr.xreplace(fresh) != d.node.expr for d in _sizes(value)):
            with mode:
                value = torch.empty_strided([plain(d) for d in value.shape], [plain(d) for d in value.stride()],
                                            dtype=value.dtype, device=value.device, requires_grad=value.requires_grad)
        remade.append(value)
    return remade


def _replace(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node], name: str, module: torch.nn.Module) -> None:
    """Swap the run `nodes` for one call of `module`, its outputs read by getitem."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
        reads = []
        for i, node in enumerate(outputs):
            read = gm.graph.call_function(operator.getitem, (call, i))
            read.meta.update(node.meta)
            reads.append(read)
    for node, read in zip(outputs, reads):
        node.replace_all_uses_with(read, delete_user_cb=lambda user: user not in set(nodes))
    for node in reversed(nodes):
        gm.graph.erase_node(node)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def describe(report: RegionReport) -> str:
    """One line: regions compiled, their nodes, interpreted runs, seconds."""
    return (
        f"{len(report.sizes)} compiled regions ({sum(report.sizes)} nodes), "
        f"{report.interpreted} left interpreted, {report.seconds:.1f} s"
    )


__all__ = ["mark_regions", "CompiledRegion", "HookPoints", "Hooks", "RegionReport", "compile_regions", "cut_regions", "default_hooks", "describe"]

