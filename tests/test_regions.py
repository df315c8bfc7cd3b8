"""Typed regions (compiler/regions.py) and derived programs: regions hold nodes, follow a
replaced or copied node, and each pass leaves the program before it untouched."""

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from commfx.api import compile_program
from commfx.compiler.program import Program
from commfx.compiler.regions import LMHead
from commfx.compiler.rewrite import Rewriter
from commfx.models import load_model
from commfx.plan import Plan

commfx = torch.ops.commfx


def _program_with_a_head() -> Program:
    graph = fx.Graph()
    x = graph.placeholder("x")
    linear = graph.call_function(torch.neg, (x,))
    loss = graph.call_function(torch.sum, (linear,))
    graph.output(loss)
    program = Program(gm=fx.GraphModule(torch.nn.Module(), graph), modules={}, out_spec=pytree.tree_flatten(0)[1])
    program.regions.lm_heads.append(LMHead("w", 4, 2, loss=loss, linear=linear, ignore_index=-100, reduction="mean"))
    return program


def test_a_region_follows_the_node_that_replaces_its_own():
    program = _program_with_a_head()
    head = program.regions.lm_heads[0]
    old = head.linear
    rw = Rewriter(program, "demo")
    with rw.before(old):
        new = rw.call(torch.abs, (program.node("x"),), purpose="stands in")
    rw.replace(old, new)
    rw.finish()
    assert head.linear is new and new.graph is program.graph
    assert head.loss.args[0] is new


def test_derive_copies_the_graph_and_moves_regions_onto_the_copy():
    program = _program_with_a_head()
    derived = program.derive()
    head, copied = program.regions.lm_heads[0], derived.regions.lm_heads[0]
    assert derived.parent is program and derived.graph is not program.graph
    assert copied is not head and copied.linear.graph is derived.graph and head.linear.graph is program.graph
    assert (copied.linear.name, copied.loss.name) == (head.linear.name, head.loss.name)


def test_each_pass_leaves_the_program_before_it_as_it_was():
    """expert_parallel's program holds the exchange; its parent (lift's) still has the
    lifted block without one, on its own graph, and no all-to-all."""
    model, inputs = load_model("gpt-moe-tiny")
    program = compile_program(model, Plan.from_cli("lift,expert_parallel", world_size=2), inputs)
    lifted = program.parent
    a2a = lambda p: [n for n in p.graph.nodes if n.target is commfx.all_to_all.default]  # noqa: E731
    assert len(a2a(program)) == 2 * len(program.regions.moe_blocks) and a2a(lifted) == []
    after, before = program.regions.moe_blocks[0], lifted.regions.moe_blocks[0]
    assert after.exchange is not None and before.exchange is None
    assert after.experts[0].graph is program.graph and before.experts[0].graph is lifted.graph
    assert "expert parallel" in program.facts and "expert parallel" not in lifted.facts
    assert program.runtime.shards and not lifted.runtime.shards


def test_a_new_node_takes_the_name_it_would_have_taken_without_the_copy():
    """A derived graph remembers the names its parent used (erased ones too), so passes name
    nodes as they did when they rewrote one graph in place."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(torch.neg, (x,))
    second = graph.call_function(torch.neg, (first,))
    graph.output(second)
    second.replace_all_uses_with(first)
    graph.erase_node(second)  # neg_1 is taken for good
    program = Program(gm=fx.GraphModule(torch.nn.Module(), graph), modules={}, out_spec=pytree.tree_flatten(0)[1])
    derived = program.derive()
    made = derived.graph.call_function(torch.neg, (derived.node("neg"),))
    assert made.name == "neg_2"
