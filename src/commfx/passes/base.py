"""Pass, the pass registry, the pass manager and the verifier that runs after every pass.

A pass is a small class: a name, an options dataclass, the graph facts it requires,
ensures and refuses, a docstring that states its idea in two lines and cites its paper,
and `run(program, options, plan) -> bool` (whether it changed the graph). Facts are the
one declaration of pass order: a plan is valid when every pass finds the facts it
requires, and none it refuses, established by the passes before it.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, ClassVar

import torch
import torch.fx as fx

from ..compiler.program import Program
from ..plan import DEFAULT_CLASS, PRIORITY_CLASSES, PassSpec, Plan, PlanError


class PassError(RuntimeError):
    """A pass cannot apply to this graph (the message says why and what to do)."""


INTERLEAVED = "micro-batches interleaved"


class Pass:
    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()  # graph facts that must hold before
    ensures: ClassVar[tuple[str, ...]] = ()  # graph facts that hold after
    # facts under which this pass cannot run -> why. A graph cut into micro-batches holds
    # each region once per micro-batch, which a pass written for one copy would half rewrite.
    refuses: ClassVar[dict[str, str]] = {INTERLEAVED: "microbatch_overlap copies the graph per micro-batch, so it comes last"}

    @dataclasses.dataclass(frozen=True)
    class Options:
        pass

    @classmethod
    def check_plan(cls, plan: Plan, options: Any, model: torch.nn.Module | None) -> None:
        """Reject, before tracing, plans that cannot fit the model or topology."""

    def run(self, program: Program, options: Any, plan: Plan) -> bool:
        raise NotImplementedError

    @classmethod
    def ensured(cls, options: Any) -> tuple[str, ...]:
        """The facts this pass establishes with these options (an option can add one)."""
        return cls.ensures

    @classmethod
    def micro_batches(cls, options: Any) -> int:
        """How many pieces the pass cuts each rank's batch into (cost models size by it)."""
        return 1

    @classmethod
    def capacity_factor(cls, options: Any) -> float:
        """The expert capacity factor the pass routes with (0: dropless, or not routing)."""
        return 0.0

    @classmethod
    def applies(cls, program: Program) -> bool:
        """Whether this graph has anything for the pass to rewrite. torch.compile hands the
        backend every graph of a model (HF mask and loss code, the user's own); those without
        e.g. an MoE block skip the MoE passes instead of failing."""
        return True

    @classmethod
    def evidence(cls, program: Program, options: Any) -> dict[str, int]:
        """What this pass left in `program`, counted (e.g. {"commfx.all_to_all": 4}): the
        nodes it stamped, by op, in the graph and every pipeline stage. Passes whose work is
        not nodes (an annotation, a codec on a boundary) count that instead. Empty means the pass did
        nothing: `run_passes` records this right after the pass runs (later passes may rewrite
        its nodes again), and verify fails a plan with such a pass."""
        counts: dict[str, int] = {}
        for gm in graphs_of(program):
            for node in gm.graph.nodes:
                made_by = node.meta.get("commfx", {}).get("pass")
                if made_by == cls.name:
                    op = _op_name(node)
                    counts[op] = counts.get(op, 0) + 1
        return counts

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""


REGISTRY: dict[str, type[Pass]] = {}


def graphs_of(program: Program) -> list[torch.fx.GraphModule]:
    """The program's graph, and each pipeline stage's once it is split."""
    pipeline = program.regions.pipeline
    return [program.gm, *(stage.gm for stage in pipeline.stages)] if pipeline is not None else [program.gm]


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return f"{node.op}:{target}" if node.op != "call_method" else target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def rewrite_census(program: Program, plan: Plan) -> dict[str, dict[str, int]]:
    """Each pass of `plan` -> what it left in the graph right after it ran (Pass.evidence),
    {} for a pass that did nothing or did not run."""
    recorded = program.rewrites
    return {spec.name: dict(recorded.get(spec.name, {})) for spec in plan.passes}


def no_op_passes(census: dict[str, dict[str, int]]) -> list[str]:
    """The passes of a census that left nothing behind."""
    return [name for name, found in census.items() if not found]


def register(cls: type[Pass]) -> type[Pass]:
    if cls.name in REGISTRY:
        raise ValueError(f"pass {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


def get_pass(name: str) -> type[Pass]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise PlanError(f"unknown pass {name!r}{_spelling_hint(name)}; registered passes: {', '.join(REGISTRY)} (see `commfx passes`)") from None


def _spelling_hint(name: str) -> str:
    """`lift;expert_parallel` (a ';' between passes) or a near miss (`expert-parallel`)."""
    if ";" in name and all(part.strip() in REGISTRY for part in name.split(";")):
        return f": passes are separated by ',' (--passes {','.join(part.strip() for part in name.split(';'))})"
    close = difflib.get_close_matches(name.lower().replace("-", "_"), REGISTRY, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_plan(plan: Plan, model: torch.nn.Module | None = None) -> Plan:
    """Check a plan before anything is traced: its topology, that every pass exists, comes
    once and after the passes it needs, that its options parse, and (given the model) that
    each pass fits it. Errors say what is wrong and how to fix it, with the user's own pass
    list corrected where it can be."""
    plan.validate()
    if plan.topology.tp > 1 and "tensor_parallel" not in plan.pass_names():
        raise PlanError(
            f"tensor-parallel size {plan.topology.tp} needs the tensor_parallel pass, e.g. "
            f"--passes {_in_order((PassSpec('lift'), *[s for s in plan.passes if s.name != 'lift'], PassSpec('tensor_parallel')))}"
        )
    if plan.topology.tp > 1 and plan.topology.pp > 1:
        raise PlanError(
            f"tensor parallelism (tp={plan.topology.tp}) inside pipeline stages (pp={plan.topology.pp}) is not "
            "supported yet; use --tp with --pp 1, or --pp with --tp 1"
        )
    for spec in plan.passes:
        if spec.name not in REGISTRY and "=" in spec.name:
            raise PlanError(
                f"{spec.name!r} is not a pass: it looks like an option. Options of one pass are separated by ';' "
                f"and passes by ',': --passes \"{_options_joined(plan.passes)}\""
            )
    seen: list[str] = []
    facts: dict[str, str] = {}  # fact -> the pass of the plan that established it
    for spec in plan.passes:
        pass_cls = get_pass(spec.name)
        if spec.name in seen:
            raise PlanError(f"pass {spec.name!r} appears twice in the plan; list it once")
        missing = [r for r in _with_prerequisites(pass_cls.requires) if r not in seen]
        if missing:
            later = [r for r in missing if r in plan.pass_names()]
            where = f" (the list has {', '.join(later)} after it)" if later else ""
            raise PlanError(
                f"pass {spec.name!r} needs {', '.join(missing)} before it{where}; for example --passes {_in_order(plan.passes)}"
            )
        options = build_options(pass_cls, spec.options)
        _check_refusals(plan, spec.name, pass_cls, options, facts)
        seen.append(spec.name)
        facts.update((fact, spec.name) for fact in pass_cls.ensured(options))
        pass_cls.check_plan(plan, options, model)
    if plan.topology.pp > 1 and "pipeline_split" not in plan.pass_names():
        raise PlanError(
            f"pipeline-parallel size {plan.topology.pp} needs the pipeline_split pass (without it every rank would run "
            f"the whole model), e.g. --passes {_in_order((PassSpec('lift'), *[s for s in plan.passes if s.name != 'lift'], PassSpec('pipeline_split')))}"
        )
    return plan


def _check_refusals(plan: Plan, name: str, pass_cls: type[Pass], options: Any, facts: dict[str, str]) -> None:
    """Refuse `name` where an earlier pass established a fact it refuses: it must come
    before that pass, or, where it cannot (it needs that pass, or that pass refuses what
    `name` establishes), the two do not combine."""
    for fact, why in pass_cls.refuses.items():
        if fact not in facts:
            continue
        earlier = facts[fact]
        mutual = set(pass_cls.ensured(options)) & set(get_pass(earlier).refuses)
        if mutual and fact == INTERLEAVED:  # the earlier pass has the specific reason
            name, earlier, why = earlier, name, get_pass(earlier).refuses[next(iter(mutual))]
        if mutual or earlier in _with_prerequisites(pass_cls.requires):
            raise PlanError(f"{name} does not work with {written(plan.spec_for(earlier))} yet: {why}" + ("; drop one of them" if mutual else ""))
        names = [s.name for s in plan.passes if s.name != name]
        names.insert(names.index(earlier), name)
        fixed = ",".join(written(plan.spec_for(n)) for n in names)
        raise PlanError(f"{name} must come before {earlier} ({why}); for example --passes {fixed}")


def plan_micro_batches(plan: Plan) -> int:
    """How many micro-batches the plan's passes cut each rank's batch into."""
    count = 1
    for pass_cls, options in _declared(plan):
        count *= pass_cls.micro_batches(options)
    return count


def plan_capacity_factor(plan: Plan) -> float:
    """The expert capacity factor the plan routes with (0: dropless)."""
    return max((pass_cls.capacity_factor(options) for pass_cls, options in _declared(plan)), default=0.0)


def _declared(plan: Plan):
    return [(get_pass(spec.name), build_options(get_pass(spec.name), spec.options)) for spec in plan.passes]


def written(spec: PassSpec) -> str:
    """A pass spec as written on the command line."""
    return spec.name + (":" + ";".join(f"{k}={v}" for k, v in spec.options.items()) if spec.options else "")


def _options_joined(specs: tuple[PassSpec, ...]) -> str:
    """The pass list with each stray `key=value` joined to the pass before it."""
    fixed: list[PassSpec] = []
    for spec in specs:
        key, eq, value = spec.name.partition("=")
        if eq and spec.name not in REGISTRY and fixed:
            fixed[-1] = PassSpec(fixed[-1].name, {**fixed[-1].options, key.strip(): value.strip()})
        else:
            fixed.append(spec)
    return ",".join(map(written, fixed))


def _in_order(specs: tuple[PassSpec, ...]) -> str:
    """The user's passes (with their options), each after what it needs, prerequisites added."""
    by_name = {spec.name: spec for spec in specs}
    ordered: list[str] = []
    for spec in specs:
        for name in _with_prerequisites(get_pass(spec.name).requires) + [spec.name]:
            if name not in ordered:
                ordered.append(name)
    return ",".join(written(by_name.get(name, PassSpec(name))) for name in ordered)


def _with_prerequisites(facts: tuple[str, ...]) -> list[str]:
    """The passes that establish `facts`, and what they need in turn, in plan order."""
    ordered: list[str] = []
    for fact in facts:
        name = _provider(fact)
        for needed in _with_prerequisites(get_pass(name).requires) + [name]:
            if needed not in ordered:
                ordered.append(needed)
    return ordered


def _provider(fact: str) -> str:
    """The registered pass that establishes `fact`."""
    providers = [name for name, cls in REGISTRY.items() if fact in cls.ensures]
    if not providers:
        raise PlanError(f"no registered pass establishes the fact {fact!r}")
    return providers[0]


def plan_options(plan: Plan, name: str):
    """The typed options dataclass of pass `name` as the plan sets them (validated)."""
    return build_options(get_pass(name), plan.spec_for(name).options)


def build_options(pass_cls: type[Pass], raw: dict[str, Any]):
    """Turn a dict of (possibly string) values into the pass's options dataclass."""
    options_cls = pass_cls.Options
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise PlanError(f"pass {pass_cls.name!r} has no option {', '.join(unknown)}; its options are: {valid}")
    return options_cls(**{key: _coerce(pass_cls.name, key, value, fields[key]) for key, value in raw.items()})


def _coerce(pass_name: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    if not isinstance(value, str):
        return value
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        raise PlanError(f"option {key}={value!r} of pass {pass_name!r} must be of type {kind}") from None
    return value


# Called as observe("before" | "after", pass name, program) around each pass that runs.
PassObserver = Callable[[str, str, Program], None]


def run_passes(
    program: Program,
    plan: Plan,
    *,
    stop_after: str | None = None,
    where_applicable: bool = False,
    observe: PassObserver | None = None,
) -> Program:
    """Run the plan's passes in order, each on its own derived copy of the program (its
    `parent` the program before it), verifying the graph after each one; returns the last.

    `where_applicable`: skip a pass whose `applies(program)` is false (the compile backend,
    which sees graph fragments), recording it in the history; otherwise every pass runs and
    says itself what is missing.

    `observe`: called right before a pass runs and right after it (once verified), e.g. to
    snapshot the rendered program around one pass (`commfx dump --diff PASS`). It sees the
    live program and must not change it; nothing is copied for it.
    """
    for spec in plan.passes:
        pass_cls = get_pass(spec.name)
        if where_applicable and not pass_cls.applies(program):
            program.history.append(f"{spec.name}: skipped (nothing to rewrite in this graph)")
            continue
        missing = [fact for fact in pass_cls.requires if fact not in program.facts]
        if missing:
            raise PassError(f"pass {spec.name!r} requires {', '.join(missing)}; run the pass that establishes it first")
        options = plan_options(plan, spec.name)
        if observe is not None:
            observe("before", spec.name, program)
        program = program.derive()
        changed = pass_cls().run(program, options, plan)
        program.facts.update(pass_cls.ensured(options))
        program.history.append(f"{spec.name}: {'changed' if changed else 'no change'}")
        program.rewrites[spec.name] = pass_cls.evidence(program, options)
        verify_graph(program, plan)
        if observe is not None:
            observe("after", spec.name, program)
        if stop_after == spec.name:
            break
    return program


# ------------------------------------------------------------------------------ verifier

COMM_OPS = ("all_to_all", "exchange_counts", "all_reduce", "tp_copy")
RANK_QUERIES = {"get_rank", "get_world_size", "get_process_group_ranks"}


def verify_graph(program: Program, plan: Plan) -> None:
    """Lint the graph and check the SPMD invariants every pass must keep."""
    graph = program.graph
    graph.lint()
    known_groups = set(plan.topology.process_groups())
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target_name = getattr(node.target, "__name__", str(node.target))
        if target_name in RANK_QUERIES or "get_rank" in str(node.target):
            raise PassError(f"node {node.name} queries the rank inside the graph; rank-dependent values must be runtime inputs")
        if _is_commfx(node, COMM_OPS):
            group = node.args[3] if node.target is torch.ops.commfx.all_to_all.default else node.args[1]
            if group not in known_groups:
                raise PassError(f"node {node.name} uses process group {group!r}, which the plan does not define")
            priority_at = {torch.ops.commfx.all_to_all.default: 4, torch.ops.commfx.exchange_counts.default: 3}.get(node.target)
            has_arg = priority_at is not None and len(node.args) > priority_at
            priority = node.args[priority_at] if has_arg else node.kwargs.get("priority", DEFAULT_CLASS)
            if priority not in PRIORITY_CLASSES:
                raise PassError(f"node {node.name} uses priority class {priority!r}, which is not registered")
    verify_waits(graph)


def verify_waits(graph: fx.Graph) -> None:
    """Every split-phase collective (c10d functional or commfx start) has a matching wait."""
    for node in graph.nodes:
        target = str(node.target)
        started = ("_c10d_functional" in target and "wait_tensor" not in target) or node.target is torch.ops.commfx.all_to_all_start.default
        if started and not any("wait_tensor" in str(user.target) for user in node.users):
            raise PassError(f"collective {node.name} has no matching wait_tensor")


def _is_commfx(node: fx.Node, names: tuple[str, ...]) -> bool:
    return any(node.target is getattr(torch.ops.commfx, n).default for n in names)
