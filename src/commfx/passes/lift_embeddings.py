"""lift's embedding recognisers: every table lookup becomes `commfx.embedding`.

A lookup is a call in EMBEDDING_CALLS (what `nn.Embedding`, HF `embed_tokens`/`wte` and a
bare `F.embedding` capture as) on a 2-D parameter. Each table is recorded once, with all
its lookups, in `program.regions.embeddings`. A table is *tied* when its weight is
used by anything other than lookups (an LM head sharing it: `lm_head.weight =
embed.weight`): the head touches every row, so its gradient is dense and later passes
must not treat it as sparse. Lookups torch itself treats specially stay verbatim, with a
note: `max_norm` (renormalises rows in place), `scale_grad_by_freq` (scales by the
batch's own counts, so a rank's gradient is not its share of the global one) and
`sparse=True` (torch's sparse gradients).
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import ops  # noqa: F401  (registers torch.ops.commfx)
from ..compiler.program import Program, module_path
from ..compiler.regions import EmbeddingTable
from ..compiler.rewrite import Pattern, Rewriter

commfx = torch.ops.commfx

# call target -> how its arguments bind (the F.embedding signature; aten's puts weight first)
EMBEDDING_CALLS = {
    F.embedding: inspect.signature(F.embedding),
    torch.ops.aten.embedding.default: inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d) for n, d in
         (("weight", inspect.Parameter.empty), ("input", inspect.Parameter.empty), ("padding_idx", -1),
          ("scale_grad_by_freq", False), ("sparse", False))]
    ),
}


def lift_embeddings(program: Program, rw: Rewriter) -> tuple[list[EmbeddingTable], list[str]]:
    """Rewrite every plain lookup to commfx.embedding; returns (tables, lookups kept verbatim and why)."""
    tables: dict[str, EmbeddingTable] = {}
    kept: list[str] = []

    def table_lookup(rw: Rewriter, node: fx.Node) -> fx.Node | None:
        bound = EMBEDDING_CALLS[node.target].bind(*node.args, **node.kwargs).arguments
        weight, ids = bound["weight"], bound["input"]
        value = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and isinstance(value, torch.Tensor) and value.dim() == 2):
            kept.append(f"{node.name}: its table is not a 2-D parameter")
            return None
        special = [k for k in ("max_norm", "scale_grad_by_freq", "sparse") if bound.get(k) not in (None, False)]
        if special:
            kept.append(f"{weight.target}: looked up with {', '.join(special)}, which lift keeps as torch does it")
            return None
        padding = _padding_row(node.target, bound.get("padding_idx"), value.shape[0])
        lookup = rw.call(
            commfx.embedding.default, (weight, ids, padding), like=node, keep=("example_value", "stack_trace"),
            purpose=f"embedding lookup of {weight.target} [{value.shape[0]} x {value.shape[1]}]",
        )
        table = tables.setdefault(weight.target, EmbeddingTable(
            weight.target, module_path(lookup) or "", value.shape[0], value.shape[1], padding, value.requires_grad,
        ))
        table.lookups.append(lookup)
        return lookup

    rw.rewrite([(Pattern(EMBEDDING_CALLS), table_lookup)])
    for table in tables.values():
        table.tied_with = _other_uses(program, table.weight)
    return list(tables.values()), kept


def _padding_row(target, padding_idx, num_rows: int) -> int:
    """The padding row as a non-negative index, or -1 for none. F.embedding counts a negative
    padding_idx from the end (None: none); aten.embedding's -1 means none."""
    if padding_idx is None or (target is not F.embedding and padding_idx == -1):
        return -1
    return padding_idx + num_rows if padding_idx < 0 else int(padding_idx)


def attribute(program: Program, target: str):
    owner_path, _, leaf = target.rpartition(".")
    return getattr(program.gm.get_submodule(owner_path) if owner_path else program.gm, leaf)


def _other_uses(program: Program, target: str) -> list[str]:
    """Where the table's weight is used other than by a lookup (an LM head sharing it)."""
    weight = attribute(program, target)
    uses = []
    for node in program.graph.nodes:
        if node.op != "get_attr" or attribute(program, node.target) is not weight:
            continue
        for user in node.users:
            if user.target is not commfx.embedding.default:
                where = module_path(user)
                uses.append(f"{where or user.name} ({getattr(user.target, '__name__', user.target)})")
    return uses
