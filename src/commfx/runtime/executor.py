"""The graph executor: runs a rewritten graph on this rank, torch.fx Interpreter style.

Subclasses override a short, documented set of methods:
- `run_node(node)`: every node (timing and tracing hooks go here);
- `call_collective(node, args, kwargs)`: nodes that communicate (commfx comm ops).
The comm scheduler is active for the whole run, so comm ops find it.
"""

from __future__ import annotations

import torch.fx as fx

from .comm import CommScheduler, active

COMM_OPS = {"all_to_all", "exchange_counts"}


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "commfx" and (
        node.target._opname in COMM_OPS
    )


class GraphExecutor(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, scheduler: CommScheduler):
        super().__init__(gm, garbage_collect_values=True)
        self.scheduler = scheduler

    def run(self, *args):
        with active(self.scheduler):
            return super().run(*args)

    def run_node(self, node: fx.Node):
        if is_collective(node):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            return self.call_collective(node, args, kwargs)
        return super().run_node(node)

    def call_collective(self, node: fx.Node, args, kwargs):
        """Issue a communication node (override to time, trace or reorder it)."""
        return node.target(*args, **kwargs)



__all__ = ["GraphExecutor", "is_collective"]
