"""Pass, the pass registry and pass options (the pass manager is compiler/pass_manager.py).

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

from ..compiler.program import PassError, Program
from ..plan import PassSpec, Plan, PlanError

__all__ = ["DEFERRED", "INTERLEAVED", "REGISTRY", "Pass", "RuntimeSetting", "PassError", "build_options", "get_pass", "plan_options", "register", "written"]


INTERLEAVED = "micro-batches interleaved"
DEFERRED = "gradient sync deferred"


class Pass:
    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()  # graph facts that must hold before
    ensures: ClassVar[tuple[str, ...]] = ()  # graph facts that hold after
    # facts under which this pass cannot run -> why. A graph cut into micro-batches holds
    # each region once per micro-batch, which a pass written for one copy would half rewrite.
    refuses: ClassVar[dict[str, str]] = {INTERLEAVED: "microbatch_overlap copies the graph per micro-batch, so it comes last"}
    rewrites: ClassVar[tuple[str, ...]] = ()  # the fields of program.regions the pass works on

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
    def refused(cls, options: Any) -> dict[str, str]:
        """The facts this pass refuses with these options (an option can lift a refusal)."""
        return cls.refuses

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
        """Whether this graph has anything for the pass to rewrite: any of the regions it
        names in `rewrites` (all graphs when it names none). torch.compile hands the backend
        every graph of a model (HF mask and loss code, the user's own); those without e.g. an
        MoE block skip the MoE passes instead of failing."""
        return not cls.rewrites or any(getattr(program.regions, region) for region in cls.rewrites)

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


class RuntimeSetting(Pass):
    """A pass whose whole work is one field of `program.runtime` (the graph is unchanged, so
    it may follow any pass): `setting` names the field, `value(options)` sets it and
    `note(options)` says in `commfx dump` what the runtime will do."""

    setting: ClassVar[str]
    refuses = {}

    @classmethod
    def value(cls, options: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def note(cls, options: Any) -> str | None:
        return None

    @classmethod
    def evidence(cls, program: Program, options: Any) -> dict[str, int]:
        return {f"{cls.setting}: {getattr(program.runtime, cls.setting)}": 1}

    def run(self, program: Program, options: Any, plan: Plan) -> bool:
        setattr(program.runtime, self.setting, self.value(options))
        note = self.note(options)
        if note:
            program.notes.append(f"{self.name}: {note}")
        return False


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


FACT_LISTS = ("requires", "ensures", "rewrites")  # declared as one string or a tuple


def register(name: str, **declared: Any) -> Callable[[type[Pass]], type[Pass]]:
    """`@register("partition_a2a", requires=..., ensures=..., rewrites=...)`: the pass's
    name and facts, declared once where the pass is registered (a string for one fact)."""

    def add(cls: type[Pass]) -> type[Pass]:
        if name in REGISTRY:
            raise ValueError(f"pass {name!r} registered twice")
        cls.name = name
        for key, value in declared.items():
            setattr(cls, key, (value,) if isinstance(value, str) and key in FACT_LISTS else value)
        REGISTRY[name] = cls
        return cls

    return add


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
