"""The pass manager: checks a plan before anything is traced, runs its passes in order on
derived programs, and records what each pass left (the rewrite census).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..passes.base import INTERLEAVED, REGISTRY, Pass, build_options, get_pass, plan_options, written
from ..plan import PassSpec, Plan, PlanError
from .graph_checks import verify_graph
from .precision import REFUSED_UNDER_MIXED_PRECISION
from .program import PassError, Program


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
        if plan.precision != "fp32" and spec.name in REFUSED_UNDER_MIXED_PRECISION:
            raise PlanError(
                f"{spec.name} does not work under --precision {plan.precision} yet: {REFUSED_UNDER_MIXED_PRECISION[spec.name]}; "
                f"use --precision fp32 with it, or drop it"
            )
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
    for fact, why in pass_cls.refused(options).items():
        if fact not in facts:
            continue
        earlier = facts[fact]
        theirs = get_pass(earlier).refused(plan_options(plan, earlier))
        mutual = set(pass_cls.ensured(options)) & set(theirs)
        if mutual and fact == INTERLEAVED:  # the earlier pass has the specific reason
            name, earlier, why = earlier, name, theirs[next(iter(mutual))]
        if mutual or earlier in _with_prerequisites(pass_cls.requires):
            raise PlanError(f"{name} does not work with {written(plan.spec_for(earlier))} yet: {why}" + ("; drop one of them" if mutual else ""))
        names = [s.name for s in plan.passes if s.name != name]
        names.insert(names.index(earlier), name)
        fixed = ",".join(written(plan.spec_for(n)) for n in names)
        raise PlanError(f"{name} must come before {earlier} ({why}); for example --passes {fixed}")


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



def rewrite_census(program: Program, plan: Plan) -> dict[str, dict[str, int]]:
    """Each pass of `plan` -> what it left in the graph right after it ran (Pass.evidence),
    {} for a pass that did nothing or did not run."""
    recorded = program.rewrites
    return {spec.name: dict(recorded.get(spec.name, {})) for spec in plan.passes}


def no_op_passes(census: dict[str, dict[str, int]]) -> list[str]:
    """The passes of a census that left nothing behind."""
    return [name for name, found in census.items() if not found]
