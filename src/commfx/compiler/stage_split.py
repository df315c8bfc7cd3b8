"""Cutting a program into pipeline stages (for pipeline_split): which node runs in which
stage, each stage's own graph module with what it receives and sends, and the parent graph
that calls the stages in order.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from .program import PassError, Program, module_paths
from .rewrite import Rewriter
from .stages import INPUT_PREFIX, Boundary, BoundaryTensor, Pipeline, Stage



def is_scalar(node: fx.Node) -> bool:
    """Size arithmetic (SymInt values): recomputed where needed, never sent."""
    value = node.meta.get("example_value")
    if node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int):
        return True
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and node.op != "placeholder"


def assign_stages(graph: fx.Graph, layer_of: dict[fx.Node, int], layer_stage: dict[int, int]) -> dict[fx.Node, int]:
    """Every compute node's stage: its layer's, else the stage of the last layer before it
    (so embeddings go first and the head last). getitem follows its source."""
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or is_scalar(node):
            continue
        if node in layer_of:
            current = max(current, layer_stage[layer_of[node]])
            stage_of[node] = layer_stage[layer_of[node]]
        elif node.target is operator.getitem and node.args[0] in stage_of:
            stage_of[node] = stage_of[node.args[0]]
        else:
            stage_of[node] = current
    for node, stage in stage_of.items():
        for arg in node.all_input_nodes:
            if stage_of.get(arg, -1) > stage:
                raise PassError(
                    f"node {node.name} (stage {stage}) uses {arg.name} from the later stage {stage_of[arg]}: "
                    "the model's layers do not run in order; pipeline_split needs layers applied one after another"
                )
    return stage_of


def _needs_grad(program: Program) -> dict[fx.Node, bool]:
    """Whether a node's value is floating and downstream of a trainable parameter."""
    out: dict[fx.Node, bool] = {}
    for node in program.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "get_attr":
            attr = _attr(program.gm, node.target)
            out[node] = isinstance(attr, torch.Tensor) and attr.requires_grad
        elif node.op == "placeholder" or is_scalar(node):
            out[node] = False
        else:
            floating = not isinstance(value, torch.Tensor) or value.is_floating_point()
            out[node] = floating and any(out.get(a, False) for a in node.all_input_nodes)
    return out


def _attr(gm: fx.GraphModule, target: str):
    owner = gm
    for part in target.split("."):
        owner = getattr(owner, part)
    return owner


def _input_name(program: Program, node: fx.Node) -> str:
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    names = program.input_names or [n.name for n in placeholders]
    return INPUT_PREFIX + names[placeholders.index(node)]


def build_pipeline(program: Program, stage_of: dict[fx.Node, int], stages: int, layer_stage: dict[int, int]) -> Pipeline:
    graph = program.graph
    output_node = next(n for n in graph.nodes if n.op == "output")
    flat_outputs: list[fx.Node] = []
    fx.node.map_arg(output_node.args[0], flat_outputs.append)
    last = stages - 1
    needs_grad = _needs_grad(program)

    # Which stages need each produced value (as a graph input, or as a model output).
    def sources(node: fx.Node) -> list[fx.Node]:
        """The values `node` reads, looking through recomputed size arithmetic."""
        found = []
        for arg in node.all_input_nodes:
            found.extend(sources(arg) if is_scalar(arg) else [arg])
        return found

    consumers: dict[fx.Node, set[int]] = defaultdict(set)
    for node, stage in stage_of.items():
        for arg in sources(node):
            if arg.op not in ("placeholder", "get_attr") and stage_of[arg] != stage:
                consumers[arg].add(stage)
    for node in flat_outputs:
        if node.op == "get_attr":
            raise PassError(f"the model returns the parameter {node.target}; pipeline_split needs outputs computed from inputs")
        if node.op != "placeholder" and stage_of.get(node) != last:
            consumers[node].add(last)

    boundaries = []
    for k in range(stages - 1):
        carried = [n for n in graph.nodes if n in consumers and stage_of[n] <= k < max(consumers[n])]
        tensors = []
        for n in carried:
            value = n.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                raise PassError(f"value {n.name} crosses pipeline boundary {k} but is not a tensor ({type(value).__name__})")
            paths = module_paths(n)
            tensors.append(
                BoundaryTensor(n.name, value.dtype, needs_grad[n], paths[-1][0] if paths else "", str(list(value.shape)), value.dim())
            )
        boundaries.append(Boundary(k, tensors))

    result_stages = []
    held: dict[str, list[int]] = defaultdict(list)
    for s in range(stages):
        nodes = [n for n in graph.nodes if stage_of.get(n) == s]
        produced_needed = [n for n in nodes if n in consumers or (s == last and n in flat_outputs)]
        stage = _extract_stage(program, s, nodes, stage_of, produced_needed, boundaries[s - 1].names if s else [])
        stage.layers = sorted(layer for layer, st in layer_stage.items() if st == s)
        for name in stage.parameters:
            held[name].append(s)
        result_stages.append(stage)
    shared = {name: where for name, where in held.items() if len(where) > 1}
    model_outputs = [_input_name(program, n) if n.op == "placeholder" else n.name for n in flat_outputs]
    return Pipeline(result_stages, boundaries, model_outputs, shared=shared)


def _extract_stage(program: Program, s: int, nodes: list[fx.Node], stage_of, outputs: list[fx.Node], received: list[str]) -> Stage:
    """One stage's graph module: placeholders for model inputs and received values, its own
    nodes (with recomputed size arithmetic and its own view of the parameters), and a tuple
    of the values later stages need."""
    inside = set(nodes)
    locals_, externals = [], []

    def collect(arg: fx.Node) -> None:
        if arg in inside or arg.op == "get_attr":
            return
        if arg.op == "placeholder":
            if arg not in locals_:
                locals_.append(arg)
        elif is_scalar(arg):
            for sub in arg.all_input_nodes:
                collect(sub)
        elif arg not in externals:
            externals.append(arg)

    for node in nodes:
        for arg in node.all_input_nodes:
            collect(arg)
    placeholder_order = [n for n in program.graph.nodes if n.op == "placeholder"]
    locals_.sort(key=placeholder_order.index)
    missing = [e.name for e in externals if e.name not in received]
    if missing:
        raise PassError(f"internal: stage {s} needs {missing}, which its boundary does not carry")
    externals.sort(key=lambda e: received.index(e.name))

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for node in locals_:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        inputs.append(_input_name(program, node))
    for node in externals:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        inputs.append(node.name)
    parameters: list[str] = []

    def value(arg: fx.Node) -> fx.Node:
        if arg in env:
            return env[arg]
        if arg.op == "get_attr":
            new = graph.get_attr(arg.target)
            if isinstance(_attr(program.gm, arg.target), torch.nn.Parameter):
                parameters.append(arg.target)
        elif is_scalar(arg):
            new = graph.node_copy(arg, value)  # recomputed here (sizes never travel)
        else:
            raise PassError(f"internal: stage {s} reads {arg.name}, which it neither computes nor receives")
        new.meta = dict(arg.meta)
        env[arg] = new
        return new

    for node in nodes:
        env[node] = graph.node_copy(node, value)
    graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(program.gm, graph, class_name=f"Stage{s}")
    return Stage(s, gm, inputs, [n.name for n in outputs], parameters)


def parent_module(program: Program, pipeline: Pipeline) -> fx.GraphModule:
    """A graph that calls the stages in order: the whole model again, in one process (what
    `commfx dump` shows and what a single-process run of the split program computes)."""
    root = torch.nn.Module()
    graph = fx.Graph()
    rw = Rewriter(graph, "pipeline_split")
    env: dict[str, fx.Node] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            new = graph.placeholder(node.name)
            new.meta = dict(node.meta)
            env[_input_name(program, node)] = new
    for stage in pipeline.stages:
        name = f"stage_{stage.index}"
        root.add_module(name, stage.gm)
        call = rw.call(name, tuple(env[i] for i in stage.inputs), op="call_module", purpose=f"pipeline stage {stage.index}")
        for i, out in enumerate(stage.outputs):
            env[out] = rw.call(operator.getitem, (call, i))
    output_node = next(n for n in program.graph.nodes if n.op == "output")

    def resolve(node: fx.Node) -> fx.Node:
        return env[_input_name(program, node)] if node.op == "placeholder" else env[program.node(node.name).name]

    graph.output(fx.node.map_arg(output_node.args[0], resolve))
    return fx.GraphModule(root, graph, class_name="PipelineModel")
