"""The rewrite engine: the one place passes build, replace and erase graph nodes.

A pass binds a `Rewriter` to its program (or to a graph it builds) and its name. Every
node it makes goes through `call`: inserted at the graph's insertion point, given the
module stack of the node it stands in for (`like`, plus any fake values the pass asks to
`keep`), and stamped with the pass and its purpose, so dumps show provenance. `replace`
and `erase_dead` retire what the new nodes replace, and the program's regions follow a
replaced (or copied) node to its replacement; `finish` recompiles once and writes the
history record. Rules kept as data (tinygrad's PatternMatcher in miniature): a
`Pattern` matches a node by op, target(s), arguments and a predicate, and names what it
captures; `Rewriter.rewrite(rules)` runs (pattern, builder) pairs over the graph and
counts matches and rewrites.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch.fx as fx

from .program import Program, stamp

_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A node shape: `op`, one of `target` (None: any), positional `args` matched in turn
    (a Pattern, a capture name, or None for anything) and a predicate `where(node)`.
    `name` captures the matched node itself."""

    target: Any = None
    args: tuple = ()
    where: Callable[[fx.Node], bool] | None = None
    name: str | None = None
    op: str = "call_function"

    def __post_init__(self) -> None:
        target = self.target
        if target is not None and isinstance(target, (tuple, list, set, frozenset, dict)):
            object.__setattr__(self, "target", tuple(target))
        elif target is not None:
            object.__setattr__(self, "target", (target,))

    def match(self, node: Any) -> dict[str, Any] | None:
        """The captures (name -> node or argument) when `node` has this shape, else None."""
        return self._match(node, [])

    def _match(self, node: Any, matched: list[fx.Node]) -> dict[str, Any] | None:
        if not isinstance(node, fx.Node) or node.op != self.op:
            return None
        if self.target is not None and not any(node.target is t or node.target == t for t in self.target):
            return None
        if len(node.args) < len(self.args):
            return None
        captures: dict[str, Any] = {}
        for want, arg in zip(self.args, node.args):
            if isinstance(want, str):
                captures[want] = arg
            elif want is not None:
                inner = want._match(arg, matched)
                if inner is None:
                    return None
                captures.update(inner)
        if self.where is not None and not self.where(node):
            return None
        if self.name:
            captures[self.name] = node
        matched.append(node)
        return captures


Builder = Callable[..., "fx.Node | None"]


@dataclasses.dataclass
class RuleStats:
    matched: int = 0
    rewritten: int = 0


class Rewriter:
    """Builds nodes for one pass. `where` is the Program the pass rewrites, or a bare graph
    (one the pass builds from scratch, or a lowered graph); `graph` hands a Program a fresh
    graph that `finish` installs. `like` is the default node whose module stack new nodes take."""

    def __init__(self, where: Program | fx.Graph, pass_name: str, *, graph: fx.Graph | None = None, like: fx.Node | None = None):
        self.program = where if isinstance(where, Program) else None
        self.graph: fx.Graph = graph if graph is not None else (where.graph if isinstance(where, Program) else where)
        self.pass_name = pass_name
        self.like = like
        self.made: list[fx.Node] = []
        self.erased = 0
        self.stats: dict[str, RuleStats] = {}
        self.moved: dict[fx.Node, fx.Node] = {}  # node -> what stands for it now (regions follow)

    # -------------------------------------------------------------------- building

    def call(
        self, target: Any, args: Iterable = (), kwargs: dict | None = None, *, purpose: str | None = None,
        like: fx.Node | None = _UNSET, keep: tuple[str, ...] = (), op: str = "call_function",
        name: str | None = None, type_expr: Any = None,
    ) -> fx.Node:
        """Insert `op(target, *args, **kwargs)` at the insertion point. With `like` (default:
        the rewriter's), the node takes a copy of like's module stack and like's meta under
        each key of `keep` that it has; with a purpose, it is stamped with this pass."""
        node = self.graph.create_node(op, target, tuple(args), kwargs, name=name, type_expr=type_expr)
        like = self.like if like is _UNSET else like
        if like is not None:
            node.meta["nn_module_stack"] = dict(like.meta.get("nn_module_stack", {}))
            node.meta.update({key: like.meta[key] for key in keep if key in like.meta})
        if purpose:
            stamp(node, self.pass_name, purpose)
        self.made.append(node)
        return node

    def maker(self, like: fx.Node | None) -> Callable[..., fx.Node]:
        """`make(target, args, purpose=None, **options)`: `call` with `like` fixed, for a
        pass that builds many nodes standing in for one."""
        return lambda target, args, purpose=None, **options: self.call(target, args, purpose=purpose, like=like, **options)

    def method(self, name: str, args: Iterable = (), **options) -> fx.Node:
        """A `call_method` node (`x.detach()`, `x.reshape(...)`), as `call` builds it."""
        return self.call(name, args, op="call_method", **options)

    def copy(
        self, node: fx.Node, args: tuple, kwargs: dict, *, name: str | None = None, drop_meta: tuple[str, ...] = (),
        stands_for: bool = False,
    ) -> fx.Node:
        """A copy of `node` (op, target, type) on new arguments, with its meta less `drop_meta`.
        `stands_for`: the copy takes node's place in the program's regions."""
        new = self.call(node.target, args, kwargs, op=node.op, name=name, type_expr=node.type, like=None)
        new.meta = {k: v for k, v in node.meta.items() if k not in drop_meta}
        if stands_for:
            self.follow(node, new)
        return new

    def follow(self, old: fx.Node, new: fx.Node) -> None:
        """Regions that hold `old` hold `new` from now on (on a fresh graph: once installed)."""
        self.moved[old] = new
        if self.program is not None and self.graph is self.program.graph:
            self.program.regions.remap({old: new})

    def before(self, node: fx.Node):
        return self.graph.inserting_before(node)

    def after(self, node: fx.Node):
        return self.graph.inserting_after(node)

    # ------------------------------------------------------------------- retiring

    def replace(self, old: fx.Node, new: fx.Node, *, erase: bool = True) -> fx.Node:
        """Every use of `old` now uses `new`, in the graph and in the program's regions;
        `old` is erased (unless `erase=False`)."""
        old.replace_all_uses_with(new)
        self.follow(old, new)
        if erase:
            self.erase(old)
        return new

    def erase(self, *nodes: fx.Node | None) -> None:
        """Erase nodes (None skipped); each must be unused by then."""
        for node in nodes:
            if node is not None:
                self.graph.erase_node(node)
                self.erased += 1

    def erase_dead(self, region: Iterable[fx.Node]) -> None:
        """Erase a replaced region's calls that nothing uses any more, until none is left.

        Confined to the region on purpose: the graph's generic dead-code elimination treats
        an in-place method whose result is unused (`mask.scatter_(...)`) as dead, which would
        silently change code a pass leaves verbatim (group-limited routers do exactly this).
        """
        alive = [n for n in region if n.op in ("call_function", "call_method")]
        changed = True
        while changed:
            changed = False
            for node in reversed(alive):
                if not node.users:
                    self.erase(node)
                    alive.remove(node)
                    changed = True

    # ---------------------------------------------------------------------- rules

    def rewrite(self, rules: Iterable[tuple[Pattern, Builder]]) -> dict[str, RuleStats]:
        """Run (pattern, builder) rules over the graph in order, first matching rule wins.
        `builder(rewriter, node, **captures)` builds the replacement (inserted before the
        node) and returns it, or returns None to keep the node. A replaced node and the
        nodes its pattern matched inside it are erased once unused. Returns each rule's
        counts (also kept in `self.stats`), keyed by the builder's name."""
        rules = list(rules)
        for _, builder in rules:
            self.stats.setdefault(_rule_name(builder), RuleStats())
        for node in list(self.graph.nodes):
            if node.graph is not self.graph or getattr(node, "_erased", False):
                continue
            for pattern, builder in rules:
                matched: list[fx.Node] = []
                captures = pattern._match(node, matched)
                if captures is None:
                    continue
                counts = self.stats[_rule_name(builder)]
                counts.matched += 1
                with self.before(node):
                    new = builder(self, node, **captures)
                if new is not None and new is not node:
                    counts.rewritten += 1
                    self.replace(node, new, erase=False)
                    self.erase_dead(reversed(matched))
                break
        return self.stats

    # --------------------------------------------------------------------- ending

    def finish(self) -> None:
        """Install the graph (if the pass built a fresh one), recompile once, record history."""
        if self.program is None:
            return
        if self.graph is not self.program.graph:
            self.program.gm.graph = self.graph
            self.program.regions.remap(self.moved)
        self.program.gm.recompile()
        rules = "".join(f"; {name}: {s.matched} matched, {s.rewritten} rewritten" for name, s in self.stats.items())
        self.program.history.append(f"{self.pass_name}: {len(self.made)} nodes made, {self.erased} erased{rules}")


def _rule_name(builder: Builder) -> str:
    return getattr(builder, "__name__", repr(builder))
