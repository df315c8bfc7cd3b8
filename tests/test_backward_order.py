"""communicating_first: work nothing on the wire waits for moves after the work it does."""

import torch
import torch.fx as fx

from commfx.runtime.backward_order import communicating_first


def _backward(grad_logits, hidden, head, w1, x):
    head_grad = grad_logits.t() @ hidden  # local (a vocabulary-parallel shard): nothing waits for it
    grad_hidden = grad_logits @ head
    layer_grad = grad_hidden.t() @ x  # all-reduced
    scaled_head = head_grad * 2.0
    return layer_grad, scaled_head, grad_hidden @ w1


def _traced():
    return fx.symbolic_trace(_backward)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in [(6, 5), (6, 4), (5, 4), (4, 3), (6, 3)]]


def test_moves_local_work_after_the_communicated_gradient_and_keeps_the_function():
    gm = _traced()
    inputs = _inputs()
    expected = gm(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    layer_grad = output.args[0][0]

    moved = communicating_first(gm, {layer_grad})

    order = [n.name for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method"]
    assert moved == 2  # the head's gradient (a transpose and a matmul); what already ran after stays
    assert order.index(layer_grad.name) < order.index("matmul")  # head_grad: grad_logits.t() @ hidden
    assert order.index("mul") > order.index(layer_grad.name)
    gm.graph.lint()
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_nothing_urgent_leaves_the_graph_alone():
    gm = _traced()
    before = [n.name for n in gm.graph.nodes]
    assert communicating_first(gm, set()) == 0
    assert [n.name for n in gm.graph.nodes] == before
