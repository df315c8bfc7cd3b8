"""The rewrite engine (compiler/rewrite.py): node building, patterns, rule rewrites, and
that passes build nodes only through it."""

import operator
import pathlib

import pytest
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from commfx.compiler.program import Program
from commfx.compiler.rewrite import Pattern, Rewriter

STACK = {"L__self___mlp": ("L['self'].mlp", torch.nn.Linear)}


def _program() -> Program:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.neg, (x,))
    y.meta["nn_module_stack"] = dict(STACK)
    y.meta["example_value"] = torch.zeros(2)
    z = graph.call_function(torch.relu, (y,))
    z.meta["nn_module_stack"] = dict(STACK)
    graph.output(z)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    return Program(gm=gm, modules={}, out_spec=pytree.tree_flatten(0)[1])


def test_call_copies_module_stack_and_stamps():
    program = _program()
    neg = program.node("neg")
    rw = Rewriter(program, "demo", like=neg)
    with rw.before(program.node("relu")):
        made = rw.call(torch.abs, (neg,), purpose="why", keep=("example_value",))
        plain = rw.call(operator.getitem, (made, 0), like=None)
    assert made.meta["nn_module_stack"] == STACK and made.meta["nn_module_stack"] is not neg.meta["nn_module_stack"]
    assert made.meta["commfx"] == {"pass": "demo", "purpose": "why"}
    assert made.meta["example_value"] is neg.meta["example_value"]
    assert "commfx" not in plain.meta and "nn_module_stack" not in plain.meta
    assert [n.name for n in program.graph.nodes] == ["x", "neg", "abs_1", "getitem", "relu", "output"]
    method = rw.method("detach", (neg,), purpose="m")
    assert method.op == "call_method" and method.target == "detach"
    assert rw.made == [made, plain, method]


def test_replace_erases_and_finish_recompiles_once_with_history():
    program = _program()
    neg = program.node("neg")
    rw = Rewriter(program, "demo")
    with rw.before(neg):
        new = rw.call(torch.abs, (neg.args[0],), purpose="abs instead", like=neg)
    rw.replace(neg, new)
    rw.finish()
    assert program.node("abs_1") is new
    with pytest.raises(KeyError):
        program.node("neg")
    assert torch.equal(program.gm(torch.tensor([-1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert program.history == ["demo: 1 nodes made, 1 erased"]


def test_node_lookup_follows_a_changed_graph():
    program = _program()
    assert program.node("relu").target is torch.relu
    graph = fx.Graph()
    graph.output(graph.call_function(torch.sin, (graph.placeholder("x"),)))
    program.gm.graph = graph
    assert program.node("sin").graph is graph


def test_pattern_matches_targets_args_predicates_and_captures():
    program = _program()
    relu = program.node("relu")
    pattern = Pattern(torch.relu, args=(Pattern((torch.neg, torch.abs), args=("source",), name="inner"),), name="outer")
    assert pattern.match(relu) == {"source": program.node("x"), "inner": program.node("neg"), "outer": relu}
    assert Pattern(torch.relu, args=(Pattern(torch.abs),)).match(relu) is None
    assert Pattern(torch.relu, where=lambda n: len(n.users) > 5).match(relu) is None
    assert Pattern(torch.relu, args=(None, None)).match(relu) is None  # relu has one argument
    assert Pattern("relu", op="call_method").match(relu) is None
    assert Pattern().match(relu) == {} and Pattern().match(3) is None


def test_rule_rewrite_replaces_erases_dead_and_counts():
    program = _program()
    rw = Rewriter(program, "demo")

    def relu_of_neg(rw, node, x):  # relu(-x) -> max(-x, 0) spelled as clamp on the input
        return rw.call(torch.clamp, (rw.call(torch.neg, (x,), like=node),), {"min": 0}, purpose="relu(neg(x))", like=node)

    def keep(rw, node, **_):
        return None

    stats = rw.rewrite([
        (Pattern(torch.relu, args=(Pattern(torch.neg, args=("x",)),)), relu_of_neg),
        (Pattern(torch.neg), keep),
    ])
    rw.finish()
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets == [torch.neg, torch.clamp]  # the old neg and relu are gone
    assert program.node("clamp").meta["commfx"]["purpose"] == "relu(neg(x))"
    assert (stats["relu_of_neg"].matched, stats["relu_of_neg"].rewritten) == (1, 1)
    assert (stats["keep"].matched, stats["keep"].rewritten) == (1, 0)  # the old neg, visited before relu
    assert torch.equal(program.gm(torch.tensor([-1.0, 2.0])), torch.tensor([1.0, 0.0]))
    assert "relu_of_neg: 1 matched, 1 rewritten" in program.history[-1]
# A pass builds, stamps and places nodes through the rewrite engine, never with the graph's
# own node constructors.


def test_passes_build_nodes_only_through_the_engine():
    passes = pathlib.Path(__file__).resolve().parents[1] / "src" / "commfx" / "passes"
    offenders = []
    for path in sorted(passes.rglob("*.py")):
        text = path.read_text()
        for needle in ("create_node(", ".call_function(", ".call_method(", ".call_module(", 'meta["nn_module_stack"] ='):
            if needle in text:
                offenders.append(f"{path.relative_to(passes)}: {needle}")
    assert not offenders, "build nodes with commfx.compiler.rewrite.Rewriter instead: " + "; ".join(offenders)
