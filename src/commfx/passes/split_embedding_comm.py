"""split_embedding_comm: sparse, per-table embedding communication for data parallelism.

EmbRace (Li et al., ICPP 2022): a step touches only its batch's rows of an embedding table,
so instead of all-reducing the dense [V, H] gradient each table gets one of
  shard  - rows split over the ranks; ids go to their owners and rows come back
           (all-to-all, uneven), row gradients go back to the owners in backward;
  sparse - replicated; every rank sends its coalesced (row id, row gradient) pairs;
  dense  - the usual all-reduce (and always for a table tied with an LM head, whose
           gradient is dense: the head touches every row).
An untied LM head whose logits feed only the loss (`lift_heads`) is the output table: its
gradient is dense, but it is computed from the tokens' hidden states, which are small, so
`head=shard` splits it over the vocabulary (`ops/vocab_parallel.py`) and its gradient is
never all-reduced; `head=auto` picks by the same cost model, `head=dense` keeps it.
`cost.embedding` picks per table from vocabulary, width, tokens per rank, world and the
plan's link figures (`strategy=auto`), and the lookup's dump comment shows the numbers.
Gradients stay what dense data parallelism computes (sum over ranks, times the plan's
scale), so SGD, Adam and AdamW as torch defines them give the same parameters.

`schedule=2d` (EmbRace's 2D communication scheduling) takes the sparse and sharded tables'
row-gradient exchange off the critical path: the backward posts the coalesced rows to the
runtime (`runtime/row_schedule.py`), which sends them through the next step's forward, the
rows the next batch reads first; the next lookup waits for those and steps just them, and
the other rows are stepped when theirs arrive.
`schedule=step` (the default) exchanges them inside the backward.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch import nn

from ..compiler.program import Program, stamp
from ..compiler.regions import EmbeddingTable, LMHead
from ..compiler.rewrite import Rewriter
from ..plan import Plan, PlanError
from .base import Pass, PassError, register
from ..cost.embedding import STRATEGIES, Estimate, choose, estimate, estimate_head, shard_problem

commfx = torch.ops.commfx
PASS = "split_embedding_comm"
SHARD_GROUP, SHARD_REPLICAS = "ep", "edp"  # row shards use the ep blocks, like expert shards
SHARD_SPEC = {"dim": 0, "group": SHARD_GROUP, "replicated_over": SHARD_REPLICAS}
EMBED_PRIORITY = "a2a"
SCHEDULES = ("step", "2d")


PIPELINE_REFUSED = "its embedding exchange spans every rank, but only the first and last pipeline stages hold embeddings and head; use it with --pp 1"


@register(PASS, rewrites=("embeddings", "lm_heads"), requires="embeddings lifted", ensures="embedding comm",
          refuses={**Pass.refuses, "pipeline split": PIPELINE_REFUSED})
class SplitEmbeddingComm(Pass):
    """Sparse embedding communication per table: row-sharded all-to-all, sparse pairs, or dense.

    (EmbRace, ICPP 2022: sparsity-aware hybrid communication for embedding-heavy models.)
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        strategy: str = "auto"  # auto | shard | sparse | dense, for the tables below
        tables: str = ""  # '+'-separated weight names or module paths; empty: every untied table
        # True where the caller owns full-size tables (the torch.compile backend): nothing
        # shards them, so row sharding is unavailable and auto picks sparse or dense.
        shard_in_graph: bool = False
        head: str = "auto"  # auto | shard | dense: the LM head (see lift_heads), split over the vocabulary or not
        schedule: str = "step"  # step | 2d: row gradients exchanged in the backward, or into the next forward

    @classmethod
    def check_plan(cls, plan: Plan, options: Options, model) -> None:
        if options.strategy not in ("auto", *STRATEGIES):
            raise PlanError(f"split_embedding_comm strategy must be auto, {', '.join(STRATEGIES)}; got {options.strategy!r}")
        if options.head not in ("auto", "shard", "dense"):
            raise PlanError(f"split_embedding_comm head must be auto, shard or dense; got {options.head!r}")
        if options.schedule not in SCHEDULES:
            raise PlanError(f"split_embedding_comm schedule must be {' or '.join(SCHEDULES)}; got {options.schedule!r}")
        if options.schedule == "2d" and options.shard_in_graph:
            raise PlanError(
                "split_embedding_comm schedule=2d needs commfx.distribute (its runtime steps each table before the next "
                "lookup, which needs dm.attach_optimizer); under torch.compile's commfx backend use schedule=step"
            )
        if options.head == "shard" and options.shard_in_graph:
            raise PlanError(
                "split_embedding_comm head=shard needs commfx.distribute (each rank holds a block of the head's rows); "
                "under torch.compile's commfx backend use head=dense or auto"
            )
        tables = model_tables(model) if model is not None else {}
        chosen = _selected(tables, options) if model is not None else set()
        if options.strategy in ("shard", "sparse") and model is not None:
            for name in chosen:
                if tables[name]["tied_with"]:
                    raise PlanError(_tied_error(name, tables[name]["tied_with"], options.strategy))
            untied = [n for n in chosen if not tables[n]["tied_with"]]
            if not untied:
                tied = ", ".join(f"{n} (tied with {', '.join(t['tied_with'])})" for n, t in tables.items())
                raise PlanError(
                    f"split_embedding_comm strategy={options.strategy} has no table to apply to: "
                    f"{tied or 'the model has no embedding table'}. A tied table's gradient is dense (the LM head "
                    "touches every row); untie the head or use strategy=dense"
                )
        if options.strategy == "shard" and options.shard_in_graph:
            raise PlanError(
                "split_embedding_comm strategy=shard needs commfx.distribute (it holds one shard of each table per rank); "
                "under torch.compile's commfx backend use strategy=sparse or auto"
            )
        if model is None:
            return
        if options.strategy == "shard":
            parts = plan.topology.expert_parallel_size
            for name in chosen:
                problem = shard_problem(tables[name]["num_rows"], parts)
                if problem and not tables[name]["tied_with"]:
                    raise PlanError(
                        f"table {name} cannot be row-sharded: {problem}. Use strategy=sparse (or auto), "
                        f"a world/ep size dividing its rows, or pad the vocabulary to a multiple of {parts}"
                    )

    @classmethod
    def evidence(cls, program: Program, options: Options) -> dict[str, int]:
        """Tables and heads by the strategy chosen (dense is a decision too, not a rewrite)."""
        counts: dict[str, int] = {}
        for decision in program.decisions.get(PASS, {}).values():
            key = f"{decision['strategy']} {'heads' if decision.get('head') else 'tables'}"
            counts[key] = counts.get(key, 0) + 1
        return counts

    def run(self, program: Program, options: Options, plan: Plan) -> bool:
        tables = program.regions.embeddings
        tokens = program.tokens_per_rank
        if tokens is None:
            raise PassError("split_embedding_comm needs the tokens per rank (compile through commfx.compile_program)")
        rw = Rewriter(program, PASS)
        chosen = _selected({t.weight: {"tied_with": t.tied_with, "path": t.path} for t in tables}, options)
        decisions = program.decisions.setdefault(PASS, {})
        parts = plan.topology.expert_parallel_size
        changed = False
        for table in tables:
            if not table.trainable:
                continue
            weight = program.gm.get_parameter(table.weight)
            estimates = estimate(table.num_rows, table.dim, weight.element_size(), tokens, plan.topology, parts)
            if options.shard_in_graph:
                estimates["shard"] = dataclasses.replace(estimates["shard"], applicable=False, why_not="the caller owns full-size tables")
            pick, reason = _decide(table, estimates, options, table.weight in chosen)
            decisions[table.weight] = {"strategy": pick, "reason": reason, "estimates": {k: dataclasses.asdict(e) for k, e in estimates.items()}}
            purpose = f"{table.weight}: {pick} ({reason}); per rank and step: " + ", ".join(e.describe() for e in estimates.values())
            later = options.schedule == "2d" and pick != "dense"
            if later and pick == "shard" and plan.topology.world_size // parts > 1:
                raise PassError(
                    f"split_embedding_comm schedule=2d with row-sharded {table.weight}: its shards are replicated over "
                    f"{plan.topology.world_size // parts} ep groups (ep={parts} < world {plan.topology.world_size}), whose "
                    "gradient all-reduce the row schedule does not do; use strategy=sparse, ep = world, or schedule=step"
                )
            if later:
                purpose += "; schedule=2d: row gradients exchanged into the next forward, its rows first"
                program.runtime.backward_order = "communicating_first"  # the dense all-reduce starts before the head's local work
            for lookup in list(table.lookups):
                if pick == "sparse" and later:
                    _replicated_2d(program, lookup, table, plan, purpose)
                elif pick == "sparse":
                    _replicated_sparse(program, lookup, plan, purpose)
                elif pick == "shard":
                    _row_sharded(rw, lookup, table, parts, purpose, plan.grad_scale_for(SHARD_REPLICAS) if later else None)
                else:
                    stamp(lookup, PASS, purpose)
            if pick == "sparse" or later:
                program.runtime.reduced_in_graph.append(table.weight)
            if pick == "shard":
                program.runtime.shards[table.weight] = SHARD_SPEC | {"parts": parts}
            changed = changed or pick != "dense"
        changed = self._split_heads(rw, program, options, plan, tokens, decisions) or changed
        rw.finish()
        return changed

    def _split_heads(self, rw: Rewriter, program: Program, options: Options, plan: Plan, tokens: int, decisions: dict) -> bool:
        heads = program.regions.lm_heads
        if options.head == "shard" and not heads:
            kept = program.regions.kept_heads or ["no cross_entropy over a linear in the graph"]
            raise PassError(
                "split_embedding_comm head=shard: the graph has no LM head to split. A head can be split when its "
                "logits feed only a cross_entropy loss computed in the model's forward (return the loss, not the "
                f"logits). Found: {'; '.join(kept)}. Use head=auto or head=dense"
            )
        program.notes.extend(f"{PASS}: a cross_entropy's LM head stays dense: {why}" for why in program.regions.kept_heads)
        parts = plan.topology.expert_parallel_size
        changed = False
        for head in heads:
            weight = program.gm.get_parameter(head.weight)
            estimates = estimate_head(head.num_rows, head.dim, weight.element_size(), tokens, plan.topology, parts)
            if options.shard_in_graph:
                estimates["shard"] = dataclasses.replace(estimates["shard"], applicable=False, why_not="the caller owns the full head")
            if options.head == "shard" and not estimates["shard"].applicable:
                raise PassError(f"LM head {head.weight} cannot be split over the vocabulary: {estimates['shard'].why_not}")
            pick = options.head if options.head != "auto" else choose(estimates).strategy
            reason = "head option" if options.head != "auto" else "cost model"
            decisions[head.weight] = {"strategy": pick, "reason": reason, "head": True, "estimates": {k: dataclasses.asdict(e) for k, e in estimates.items()}}
            purpose = f"LM head {head.weight}: {pick} ({reason}); per rank and step: " + ", ".join(e.describe() for e in estimates.values())
            if pick != "shard":
                stamp(head.linear, PASS, purpose)
                continue
            _vocab_parallel_head(rw, head, parts, purpose)
            program.runtime.shards[head.weight] = SHARD_SPEC | {"parts": parts}
            changed = True
        return changed


def _decide(table: EmbeddingTable, estimates: dict[str, Estimate], options, selected: bool) -> tuple[str, str]:
    if table.tied:
        return "dense", f"tied with {', '.join(table.tied_with)}: its gradient is dense"
    if options.strategy == "auto" or not selected:
        best = choose(estimates)
        return best.strategy, "cost model"
    if options.strategy == "shard" and not estimates["shard"].applicable:
        raise PassError(f"table {table.weight} cannot be row-sharded: {estimates['shard'].why_not}")
    return options.strategy, "strategy option"


def _replicated_sparse(program: Program, lookup: fx.Node, plan: Plan, purpose: str) -> None:
    weight, ids, padding = lookup.args
    args = (weight, ids, padding, "world", plan.topology.world_size, plan.grad_scale, EMBED_PRIORITY)
    lookup.target = commfx.sparse_grad_embedding.default
    lookup.args = args
    stamp(lookup, PASS, purpose)


def _replicated_2d(program: Program, lookup: fx.Node, table: EmbeddingTable, plan: Plan, purpose: str) -> None:
    weight, ids, padding = lookup.args
    lookup.target = commfx.row_embedding.default
    lookup.args = (weight, ids, padding, table.weight, "world", plan.topology.world_size, plan.grad_scale)
    stamp(lookup, PASS, purpose)


def _row_sharded(rw: Rewriter, lookup: fx.Node, table: EmbeddingTable, parts: int, purpose: str, scale: float | None = None) -> None:
    """weight[ids] -> route, ids to owners, owners' lookup, rows back, rows by token. With
    `scale` (schedule=2d) the last three are one `row_sharded_embedding`, whose backward
    posts the row gradients to the runtime (times `scale`)."""
    weight, ids, padding = lookup.args
    rows_per_part = table.num_rows // parts
    make = rw.maker(lookup)
    tag = table.weight
    with rw.before(lookup):
        route = make(commfx.embedding_route.default, (ids, table.num_rows, parts), "unique ids, grouped by owner")
        unique = make(operator.getitem, (route, 0))
        inverse = make(operator.getitem, (route, 1))
        send = make(operator.getitem, (route, 2))
        recv = make(commfx.embedding_counts.default, (send, SHARD_GROUP, EMBED_PRIORITY), "ids each owner serves")
        asked = make(commfx.embedding_all_to_all.default, (unique, send, recv, SHARD_GROUP, EMBED_PRIORITY, f"{tag} ids"), "ids to owners")
        local = make(commfx.local_rows.default, (asked, rows_per_part, SHARD_GROUP), "owner's row numbers")
        if scale is not None:
            out = make(
                commfx.row_sharded_embedding.default,
                (weight, local, inverse, ids, send, recv, padding, tag, SHARD_GROUP, parts, scale),
                "owner settles its shard, looks its rows up, rows back by token (backward: row gradients posted)",
            )
    if scale is not None:
        stamp(route, PASS, purpose)
        rw.replace(lookup, out)
        return
    with rw.before(lookup):
        served = make(commfx.embedding.default, (weight, local, -1), "owner looks its rows up (backward: adds row gradients)")
        back = make(
            commfx.embedding_all_to_all.default, (served, recv, send, SHARD_GROUP, EMBED_PRIORITY, f"{tag} rows"),
            "rows back (backward: coalesced row gradients to owners)",
        )
        out = make(commfx.embedding.default, (back, inverse, -1), "rows by token (backward: coalesce per unique id)")
        if padding >= 0:
            out = make(commfx.mask_padding_grad.default, (out, ids, padding), "no gradient for the padding row")
    stamp(route, PASS, purpose)
    rw.replace(lookup, out)


def _vocab_parallel_head(rw: Rewriter, head: LMHead, parts: int, purpose: str) -> None:
    """linear + shape ops + cross_entropy -> one commfx.vocab_parallel_loss over this rank's rows."""
    loss, linear = head.loss, head.linear
    hidden, weight = linear.args[0], linear.args[1]
    labels = loss.args[1] if len(loss.args) > 1 else loss.kwargs["target"]
    with rw.before(loss):
        rows = rw.method("reshape", (hidden, -1, head.dim), like=linear)
        targets = rw.method("reshape", (labels, -1), like=linear)
        split = rw.call(
            commfx.vocab_parallel_loss.default,
            (rows, weight, targets, head.ignore_index, head.reduction, SHARD_GROUP, parts, EMBED_PRIORITY),
            purpose=purpose, like=linear,
        )
        value = rw.call(operator.getitem, (split, 0), like=linear)
    rw.replace(loss, value, erase=False)
    dead = [loss]
    node = loss.args[0]
    while node is not linear:
        dead.append(node)
        node = node.args[0]
    rw.erase(*dead, linear)


def model_tables(model: nn.Module) -> dict[str, dict]:
    """Embedding tables of a model before capture: weight name -> rows and what it is tied with."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    tables = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            name = f"{path}.weight" if path else "weight"
            others = [n for n in owners.get(id(module.weight), []) if n != name]
            tables[name] = {"num_rows": module.num_embeddings, "tied_with": others, "path": path}
    return tables


def _selected(tables: dict[str, dict], options) -> set[str]:
    """Names of the tables the options' strategy applies to (weight names or module paths)."""
    wanted = [t for t in options.tables.split("+") if t]
    if not wanted:
        return {name for name, t in tables.items() if not t["tied_with"]}
    known = {t.get("path") for t in tables.values()} | set(tables)
    unknown = [t for t in wanted if t not in known]
    if unknown:
        raise PlanError(
            f"split_embedding_comm tables={'+'.join(wanted)}: no embedding table {', '.join(unknown)}; "
            f"the model's tables are {', '.join(sorted(n for n in tables if n.endswith('weight'))) or 'none'}"
        )
    return {name for name, t in tables.items() if name in wanted or t.get("path") in wanted}


def _tied_error(name: str, tied_with: list[str], strategy: str) -> str:
    return (
        f"split_embedding_comm strategy={strategy} on {name}, which is tied with {', '.join(tied_with)}: a tied "
        "table's gradient is dense (the LM head touches every row), so a sparse strategy would claim sparsity it "
        "does not have. Drop it from tables=, untie the head, or use strategy=dense"
    )
