"""Build benchmarks/RESULTS.md from the committed runs.

    python benchmarks/report.py           # rewrite RESULTS.md
    python benchmarks/report.py --check   # exit 1 (with a diff) when RESULTS.md is stale

Every number on the page is read here from a JSON file under benchmarks/ (or a `commfx plan`
log under benchmarks/log/, which writes no JSON) and every ratio is recomputed from the
runs' `samples_s`: medians, and for plans measured in the same interleaved rounds the median
of the per-round ratios ("paired"). The prose between the generated blocks lives in
RESULTS.template.md, which may hold no figures of its own (checked); the seeds' claims and
the targets they are held to are in claims.json. Needs no torch: it runs in a second.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE, TEMPLATE, CLAIMS = HERE / "RESULTS.md", HERE / "RESULTS.template.md", HERE / "claims.json"
MAX_LINES, HEADLINE_BY_LINE = 400, 40
RUN_FIELDS = ("commit", "command", "load", "proportions", "same rounds")


def _stdlib_module(name: str):
    """A commfx module that imports only the standard library, loaded by path (no torch)."""
    path = HERE.parent / "src" / "commfx" / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_report_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


run_record = _stdlib_module("run_record")
proportions = _stdlib_module("proportions")


# ---- numbers ---------------------------------------------------------------------------

def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (as commfx.bench.results.Timing)."""
    values = sorted(values)
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, p25, p75)."""
    return statistics.median(values), quantile(values, 0.25), quantile(values, 0.75)


def paired(samples: list[float], over: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios of two plans timed in the same rounds."""
    if len(samples) != len(over):
        raise ValueError(f"{len(samples)} rounds against {len(over)}: not timed in the same rounds")
    return spread([a / b for a, b in zip(samples, over)])


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def x(value: float) -> str:
    return f"{value:.2f}"


def xr(triple: tuple[float, float, float]) -> str:
    """A paired ratio with its quartiles: 0.57 (0.57–0.61)."""
    return f"{triple[0]:.2f} ({triple[1]:.2f}–{triple[2]:.2f})"


def pct(value: float, signed: bool = True) -> str:
    return f"{value * 100:+.2f}%" if signed else f"{value * 100:.1f}%"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} M" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} k"


# ---- runs ------------------------------------------------------------------------------

class Sources:
    """The files the page names: each read once, each remembered."""

    def __init__(self) -> None:
        self.cache: dict[str, object] = {}

    def json(self, name: str):
        if name not in self.cache:
            self.cache[name] = json.loads((HERE / name).read_text())
        return self.cache[name]

    def text(self, name: str) -> str:
        if name not in self.cache:
            self.cache[name] = (HERE / name).read_text()
        return self.cache[name]

    def bench(self, name: str) -> "Run":
        return Run(name, self.json(name))


class Run:
    """One `commfx bench` JSON."""

    def __init__(self, name: str, data: dict) -> None:
        self.name, self.d = name, data
        self.plans = {p["label"]: p for p in data["plans"]}
        self.record = data.get("run")

    def samples(self, label: str, kind: str = "wall") -> list[float]:
        return self.plans[label][kind]["samples_s"]

    def median(self, label: str, kind: str = "wall") -> float:
        return statistics.median(self.samples(label, kind))

    def balance_bound(self, healthy: str) -> float:
        """The least step ÷ the healthy step that lossless re-balancing can reach when the run's
        straggler computes its `factor` times slower: the healthy ranks' compute c, re-split in
        proportion to speed over n ranks, takes n c / (n - 1 + 1/factor); the rest of the
        healthy step (communication) is kept. Work every rank repeats cannot be re-split, so
        migration's true bound is higher; resizing (lossy) goes below it by dropping work."""
        computes, factor = self.plans[healthy]["rank_compute_only_median_s"], self.d["straggler"]["factor"]
        n, compute, step = len(computes), max(computes), self.median(healthy)
        return (step - compute + n * compute / (n - 1 + 1 / factor)) / step

    def wall(self, label: str) -> str:
        median, p25, p75 = spread(self.samples(label))
        return f"{ms(median)} ({ms(p25)}–{ms(p75)})"

    def paired(self, label: str, over: str) -> tuple[float, float, float]:
        return paired(self.samples(label), self.samples(over))

    def wire_bound(self, label: str) -> float | None:
        return self.plans[label].get("wire_bound_s")

    def wire_over_scheduler(self, label: str) -> float | None:
        wire = self.plans[label].get("wire_bytes_per_step")
        return wire.get("wire_over_scheduler") if wire else None

    def a2a_inter_node(self, label: str) -> float:
        return self.plans[label]["bytes_per_step"].get("all_to_all", {}).get("inter_node_bytes", 0.0)

    def peer_a2a(self, label: str) -> float:
        """A peer's all-to-all payload per step, all ranks (what the peer's hooks counted)."""
        return (self.plans[label].get("peer_payload_bytes_per_step") or {}).get("all_to_all", 0.0)

    def busiest_link(self, label: str) -> float | None:
        wire = self.plans[label].get("wire_bytes_per_step")
        return wire.get("busiest_link_bytes") if wire else None

    def measured_machine(self) -> list[str]:
        return [c for p in self.d["plans"] for c in (p.get("choices") or []) if c.startswith("machine measured")]

    def peer_label(self) -> str | None:
        return next((p["label"] for p in self.d["plans"] if p["passes"].startswith("peer:")), None)

    # the columns every headline row carries
    def link_layout(self) -> str:
        rate, latency = self.d.get("inter_node_rate_bits"), self.d.get("inter_node_latency_s")
        if rate is None and self.d.get("inter_node_link"):
            rate = _rate_bits(self.d["inter_node_link"])
        link = "unshaped link" if not rate else (f"{rate / 1e9:.3g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s")
        if latency:
            link += f", {latency * 1e3:g} ms"
        return f"{link}; {self.d['nodes']} × {self.d['ranks_per_node']} ranks"

    def model(self) -> str:
        return describe_model(self.d["model"], self.d.get("model_kwargs") or {})

    def proportions(self) -> str:
        return proportions_cell(self.record, self.d["model"], self.d.get("model_kwargs") or {})

    def load(self) -> str:
        return load_cell(self.record)

    def peer(self, label: str | None = None) -> str:
        label = label or self.peer_label()
        if label is None:
            return "none (commfx plans only)"
        plan = self.plans[label]
        same = plan.get("same_rounds")
        rounds = "same rounds" if same else ("not in the same rounds" if same is False else "same run (same_rounds not recorded)")
        return f"`{plan['passes']}`, {rounds}"


def _rate_bits(text: str) -> float | None:
    match = re.match(r"([\d.]+)\s*(g|m|k)bit", text.lower())
    return float(match.group(1)) * {"g": 1e9, "m": 1e6, "k": 1e3}[match.group(2)] if match else None


def describe_model(model: str, kwargs: dict) -> str:
    if model.startswith("gpt-moe"):
        kind = "dense gpt-moe (one expert)" if kwargs.get("num_experts") == 1 else f"gpt-moe {kwargs.get('num_experts', '?')} experts top-{kwargs.get('top_k', '?')}"
        return (f"{kind}, hidden {kwargs.get('hidden_size', '?')}, expert hidden {kwargs.get('expert_hidden', '?')}, "
                f"{kwargs.get('num_layers', '?')} layers, vocabulary {kwargs.get('vocab_size', '?')}")
    if model.startswith("hf:"):
        return f"`{model}` " + ", ".join(f"{k} {v}" for k, v in kwargs.items() if k != "batch")
    return f"`{Path(model.split(':')[0]).name}:{model.split(':')[1]}`" if ":" in model else f"`{model}`"


def matching_preset(model: str, kwargs: dict) -> str | None:
    """The --proportions preset whose scaled gpt-moe these kwargs are, if any."""
    if model != "gpt-moe":
        return None
    for name in proportions.REAL_MODELS:
        preset = proportions.gpt_moe_kwargs(proportions.matched_link(name, flops_per_rank=1.0, nodes=2, pp=2).model)
        if all(kwargs.get(k) == v for k, v in preset.items()):
            return name
    return None


def proportions_cell(record: dict | None, model: str, kwargs: dict) -> str:
    if record and record.get("proportions"):
        return record["proportions"]
    preset = matching_preset(model, kwargs)
    return f"not recorded (kwargs match `{preset}`)" if preset else "not recorded"


def load_cell(record: dict | None, start: list | None = None, end: list | None = None, cores: int | None = None) -> str:
    """1-minute load average at start → end and per core; **loaded** above the threshold."""
    share = None
    if record and record.get("machine"):
        machine = record["machine"]
        start, end, cores, share = machine.get("load_start"), machine.get("load_end"), machine.get("cores"), machine.get("others_cpu_share")
    if not start or not end or not cores:
        return "not recorded"
    first, last = float(start[0]), float(end[0])
    text = f"{first:.2f} → {last:.2f} on {cores} cores"
    if share is not None:
        text += f", others took {share:.0%} of the CPU"
    worst = max(first, last)
    return f"**loaded** ({text})" if run_record.loaded([worst], cores) else text


def missing_fields(data) -> list[str]:
    """Which of RUN_FIELDS a JSON does not record."""
    record = data.get("run") if isinstance(data, dict) else None
    if not record:
        missing = list(RUN_FIELDS)
        if isinstance(data, dict) and data.get("load_before"):
            missing.remove("load")
        if not (isinstance(data, dict) and "plans" in data and any(p["passes"].startswith("peer:") for p in data["plans"])):
            missing.remove("same rounds")
        return missing
    out = [f for f, key in (("commit", "commit"), ("command", "command"), ("proportions", "proportions")) if not record.get(key)]
    if not (record.get("machine") or {}).get("load_start"):
        out.append("load")
    return out


def plan_log(text: str) -> dict[str, float]:
    """Step seconds per plan from a `commfx plan` table (its log; the command writes no JSON).
    A plan wider than its column wraps onto rows whose number cell is blank."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) < 4:
            continue
        if cells[1].isdigit():
            rows.append([cells[2], cells[3]])
        elif rows and not cells[1]:
            rows[-1][0] += cells[2]
    return {plan.split(" --")[0]: float(step.removesuffix(" ms")) / 1e3 for plan, step in rows}


def plan_world(text: str) -> int:
    """Ranks a `commfx plan` log planned for (its first line: N node(s) x M rank(s))."""
    nodes, ranks = re.search(r"(\d+) node\(s\) x (\d+) rank\(s\)", text).groups()
    return int(nodes) * int(ranks)


def link_sizing(run) -> str:
    """How a --proportions run sized its link, from the command it records."""
    command = (run.d.get("run") or {}).get("command") or ""
    if "--inter-node auto" not in command:
        return "the figures that sized its link not recorded" if not command else "its link given on the command line"
    given = [flag for flag in ("--flops-per-rank", "--collective-overhead", "--grad-bucket-bytes") if flag in command]
    return (f"its link sized from given {', '.join(given)}" if given
            else "its link sized from this machine's measured FLOP/s, no cost-model figure given")


def seeds_text(quality: dict) -> str:
    """How many seeds a quality run trained each plan with (older runs: one, seed 0)."""
    seeds = quality["rows"][0].get("seeds", [0])
    return "one seed" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}, the mean of each seed's change"


def per_seed(row: dict) -> str:
    """A quality row's per-seed changes, when it has more than one seed."""
    changes = row.get("vs_uncompressed_per_seed") or []
    return f" ({', '.join(pct(c) for c in changes)})" if len(changes) > 1 else ""


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def saving_verdict(saving: float, claim: dict) -> str:
    """Where a step saving falls against a claimed range (`saving_low`–`saving_high`)."""
    if saving > claim["saving_high"]:
        return "above the claimed range"
    return "within the claimed range" if saving >= claim["saving_low"] else "below the claimed range"


def reached(ok: bool) -> str:
    return "**reached**" if ok else "**not reached**"


# ---- sections --------------------------------------------------------------------------

LOCMOE_REAL = tuple(f"locmoe_{name}_proportions_2x1.json" for name in ("mixtral", "qwen3_30b_a3b", "olmoe_1b_7b"))
LOCMOE_MIXTRAL_QUALITY = ("locmoe_quality_mixtral_proportions.json", "locmoe_quality_mixtral_f05.json")
LOCMOE_QWEN3_QUALITY = ("locmoe_quality_qwen3_proportions.json", "locmoe_quality_qwen3_f05.json")
OPTIMUS_CC_REAL = "peers_optimus_cc_gpt_2_5b_proportions_2x1.json"
OPTIMUS_CC_REAL_QUALITY = "pipeline_quality_gpt_2_5b_proportions.json"
OPTIMUS_CC_TOY = "peers_optimus_cc_pipelining_quiet_100mbit_2x1.json"
OPTIMUS_CC_TOY_QUALITY = "pipeline_quality_peer_model.json"


class Report:
    def __init__(self) -> None:
        self.src = Sources()
        self.claims = json.loads(CLAIMS.read_text())
        self.headline: list[list[str]] = []

    def row(self, name: str, figure: str, peer: str, model: str, link: str, kind: str, load: str, files: list[str]) -> None:
        self.headline.append([name, figure, peer, model, link, kind, load, ", ".join(f"`{f}`" for f in files)])

    def projection(self, log: str, plan: str, over: str) -> float:
        steps = plan_log(self.src.text(log))
        return steps[plan] / steps[over]

    def world(self, size: int, log: str | None = None) -> int:
        """The GPU count a projection log planned for (the logs are named by it)."""
        return plan_world(self.src.text(log or f"log/2026-11-26-projection_lina_embrace_a100_{size}_bf16.txt"))

    def lina(self) -> str:
        claim = self.claims["lina"]
        toy, mix = self.src.bench("peers_lina_gpt_moe_100mbit_2x1.json"), self.src.bench("peers_lina_mixtral_proportions_2x1.json")
        others = [self.src.bench(f"peers_lina_{name}_proportions_2x1.json") for name in ("qwen3_30b_a3b", "olmoe_1b_7b")]
        runs = (toy, mix, *others)
        target = {run.name: claim["target_speedup_qwen3_olmoe" if run in others else "target_speedup"] for run in runs}
        rows = []
        for run in runs:
            peer = run.peer_label()
            for label, plan in run.plans.items():
                name = "full Lina" if label == "plan" else (f"`{plan['passes']}`" if label == peer else f"{label}: `{plan['passes']}`")
                bound = run.wire_bound(label)
                rows.append([f"`{run.name}`" if label == "plan" else "″", name, run.wall(label), ms(run.median(label, "compute_only")),
                             ms(bound) if bound else "–", xr(run.paired(label, peer))])
        speed = {run.name: 1 / run.paired("plan", run.peer_label())[0] for run in runs}
        lines = [table(["run", "plan", "wall ms (p25–p75)", "compute-only ms", "wire bound ms", "÷ peer, paired (p25–p75)"], rows), ""]
        for run in runs:
            machine = run.measured_machine()
            wire = run.wire_over_scheduler("plan")
            lines.append(f"- `{run.name}`: {run.model()}; {run.link_layout()}; proportions {run.proportions()}. Full Lina "
                         f"{x(speed[run.name])}× faster than the peer (paired), against the claimed {claim['speedup']}× "
                         f"({reached(speed[run.name] >= claim['speedup'])}; the target of {target[run.name]}× "
                         f"{'met' if speed[run.name] >= target[run.name] else 'not met'}); wall "
                         f"{x(run.median('plan') / run.wire_bound('plan'))}× its wire bound; wire bytes ÷ the scheduler's count "
                         f"{x(wire) if wire else 'not counted'}. Cost-model figures: "
                         f"{'measured on the ranks' if machine else 'whether measured or given is not recorded'}.")
        check = mix.plans[mix.peer_label()].get("peer_check") or ""
        lines.append(f"- The peer was checked before timing: {check.split(' (')[0]}.")
        bf16 = [self.projection(f"log/2026-11-26-projection_lina_embrace_a100_{w}_bf16.txt", "lift,expert_parallel,partition_a2a",
                                "lift,expert_parallel") for w in (16, 32)]
        lines.append(f"- **Projected** on the `a100` preset (`projections.sh`, logs `log/2026-11-26-projection_lina_embrace_a100_*`), "
                     f"naive expert parallelism standing in for DeepSpeed-MoE, bf16: `partition_a2a` ÷ naive {x(bf16[0])} at "
                     f"{self.world(16)} GPUs and {x(bf16[1])} at {self.world(32)}: the claim is {reached(min(bf16) <= 1 / claim['speedup'])} there.")
        sizing = link_sizing(mix)
        for run in (mix, *others):
            lines.append(f"- `{run.name}`: {link_sizing(run)}; compute-only step of full Lina ÷ the peer's "
                         f"{x(run.median('plan', 'compute_only') / run.median('baseline', 'compute_only'))} (target ≤ 1), "
                         f"naive ÷ the peer's {x(run.median('naive', 'compute_only') / run.median('baseline', 'compute_only'))}; "
                         f"the peer's all-to-all bytes ÷ full Lina's {x(run.peer_a2a('baseline') / run.a2a_inter_node('plan'))} "
                         "(the peer is dropless: every expert's rows padded to the busiest expert's load).")
        chunks = self.src.bench("log/2026-11-28-lina_chunks_mixtral_2x1.json")
        per_k = {label: plan["passes"].split("partition_a2a:k=")[1].split(",")[0] for label, plan in chunks.plans.items() if "partition_a2a:k=" in plan["passes"]}
        lines.append(f"- Chunks per all-to-all, full Lina at Mixtral proportions in one run (`{chunks.name}`, {chunks.link_layout()}): "
                     + ", ".join(f"k={k}: ÷ the peer {xr(chunks.paired(label, 'baseline'))}, compute-only {ms(chunks.median(label, 'compute_only'))} ms"
                                 for label, k in sorted(per_k.items(), key=lambda item: int(item[1])))
                     + ". A chunk's host work is not hidden behind the link on a CPU rank: `k=auto` counts it in series (`cost/moe.py`).")
        self.row("**Lina**", f"full Lina ÷ `peer:deepspeed_moe` {xr(mix.paired('plan', 'baseline'))} paired "
                 f"({x(speed[mix.name])}× faster; claim {claim['speedup']}×: {reached(speed[mix.name] >= claim['speedup'])} on this emulated "
                 f"CPU cluster, {sizing}; "
                 f"projected on A100s: {reached(min(bf16) <= 1 / claim['speedup']).strip('*')}); "
                 + "; ".join(f"{run.proportions()}: {xr(run.paired('plan', 'baseline'))} ({x(speed[run.name])}× faster, target "
                             f"{target[run.name]}×: {'met' if speed[run.name] >= target[run.name] else 'not met'})" for run in others),
                 mix.peer(), "; ".join(run.model() + "; " + run.proportions() for run in (mix, *others)),
                 "; ".join(run.link_layout() for run in (mix, *others)), "measured (emulated CPU cluster)",
                 "; ".join(run.load() for run in (mix, *others)), [run.name for run in (mix, *others)])
        return "\n".join(lines)

    def locmoe(self) -> str:
        claim = self.claims["locmoe"]
        runs = [self.src.bench("locmoe_top1_100mbit_2x1.json"), self.src.bench("locmoe_top1_quiet_1gbit_2x2.json")]
        names = {"plan": "locality gate, defaults", "grap": "GrAP + locality", "model f0.3": "model scores, 30% off node",
                 "baseline": "switch", "hash": "hash", "model cap": "capacity mode: locality defaults",
                 "switch cap": "capacity mode: switch", "hash cap": "capacity mode: hash", "grap cap": "capacity mode: GrAP"}
        rows = []
        for label, name in names.items():
            row = [name, f"`{runs[0].plans[label]['passes']}`"]
            for run in runs:
                row += [run.wall(label), xr(run.paired(label, "baseline")), x(run.paired(label, "hash")[0])]
            row.append(f"{mb(runs[0].a2a_inter_node(label))} ({x(runs[0].a2a_inter_node(label) / runs[0].a2a_inter_node('baseline'))}×)")
            rows.append(row)
        head = ["router (top-1)", "passes"]
        for run in runs:
            head += [f"{run.d['nodes']} × {run.d['ranks_per_node']} wall ms", "÷ switch, paired", "÷ hash"]
        lines = [table(head + ["all-to-all B/step across nodes (÷ switch), first run"], rows), ""]
        verdicts = []
        for run in runs:
            save_switch, save_hash = 1 - run.paired("plan", "baseline")[0], 1 - run.paired("plan", "hash")[0]
            verdict = saving_verdict(min(save_switch, save_hash), claim)
            verdicts.append(f"{verdict.removesuffix(' the claimed range')} it at {run.d['nodes']} × {run.d['ranks_per_node']}")
            how = (f"save {pct(save_switch, False)} of switch's step and {pct(save_hash, False)} of hash's" if min(save_switch, save_hash) > 0
                   else f"take {x(1 - save_switch)}× switch's step and {x(1 - save_hash)}× hash's: no saving")
            lines.append(f"- `{run.name}`: {run.model()}; {run.link_layout()}; load {run.load()}. The defaults {how} (paired), claimed "
                         f"{pct(claim['saving_low'], False)}–{pct(claim['saving_high'], False)} saving: {verdict}.")
        quality = [self.src.json("locmoe_top1_quality_gpt_moe.json"), self.src.json("locmoe_top1_quality_qwen3_moe.json")]
        key = "final_loss (mean of last 10% of steps)"
        qrows = []
        for label in quality[0]["results"]:
            row = [f"`{quality[0]['results'][label]['passes']}`"]
            for q in quality:
                r = q["results"].get(label)
                if r is None:
                    row += ["–"] * 3
                    continue
                s, base = r["over_seeds"], q["results"]["switch"]["over_seeds"]
                row += [x(s["a2a_inter_node_bytes_mean"]["mean"] / base["a2a_inter_node_bytes_mean"]["mean"]),
                        x(s["load_max_over_mean"]["mean"]),
                        f"{s[key]['mean']:.4f} ± {s[key]['stdev']:.4f} ({pct(s[key]['mean'] / base[key]['mean'] - 1)})"]
            qrows.append(row)
        qhead = ["router"]
        for name, q in zip(("gpt-moe", "Qwen3-MoE"), quality):
            qhead += [f"{name} a2a ÷ switch", "load max/mean", "final loss (vs switch)"]
        cfg = quality[0]["config"]
        lines += ["", f"Quality (`benchmarks/locmoe.py`, {cfg['steps']} steps, seeds {', '.join(map(str, cfg['seeds']))}, mean ± sd; "
                  f"`locmoe_top1_quality_gpt_moe.json` toy, `locmoe_top1_quality_qwen3_moe.json` at Qwen3-30B-A3B's proportions scaled; "
                  f"load not recorded):", "", table(qhead, qrows)]
        projected = self.projection("log/2026-11-26-projection_locmoe_a100_64_bf16.txt", "lift,locality_gate,expert_parallel",
                                    "lift,locality_gate:gate=switch;mu=0,expert_parallel")
        lines.append(f"\n**Projected** on {self.world(64, 'log/2026-11-26-projection_locmoe_a100_64_bf16.txt')} A100s (`log/2026-11-26-projection_locmoe_a100_64_bf16.txt`): the locality gate saves "
                     f"{pct(1 - projected, False)} of switch's step, claimed {pct(claim['saving_low'], False)}–{pct(claim['saving_high'], False)}: "
                     f"{reached(1 - projected >= claim['saving_low'])}.")
        real, real_figure = self.locmoe_real(lines)
        first = runs[0]
        self.row("**LocMoE**", real_figure + "; toy, top-1: "
                 f"locality gate ÷ switch {xr(first.paired('plan', 'baseline'))}, ÷ hash {xr(first.paired('plan', 'hash'))} "
                 f"paired at {first.d['nodes']} × {first.d['ranks_per_node']}; ÷ switch {x(runs[1].paired('plan', 'baseline')[0])} at "
                 f"{runs[1].d['nodes']} × {runs[1].d['ranks_per_node']} (claim: a {pct(claim['saving_low'], False)}–{pct(claim['saving_high'], False)} "
                 f"saving: {'; '.join(verdicts)}; projected on A100s: {reached(1 - projected >= claim['saving_low']).strip('*')})",
                 f"{real[0].peer()}; switch and hash routers (commfx's), same run",
                 "; ".join(run.model() + "; " + run.proportions() for run in (*real, first)),
                 "; ".join(run.link_layout() for run in (*real, first)), "measured", "; ".join(run.load() for run in (*real, first)),
                 [*(run.name for run in real), *LOCMOE_MIXTRAL_QUALITY, *LOCMOE_QWEN3_QUALITY,
                  *(r.name for r in runs)])
        return "\n".join(lines)

    def locmoe_real(self, lines: list[str]) -> tuple[list["Run"], str]:
        """LocMoE's gate at real models' own top-k: the bench runs against the model's router
        without locality and the peer, and the quality at Mixtral's; appends to `lines`,
        returns the runs and their headline figure."""
        runs = [self.src.bench(name) for name in LOCMOE_REAL]
        base = "no locality"
        rows = [[f"`{run.name}`" if i == 0 else "″", f"`{p['passes']}`", run.wall(label), ms(run.median(label, "compute_only")),
                 xr(run.paired(label, base)), xr(run.paired(label, "baseline")),
                 mb(run.a2a_inter_node(label) if not p.get("peer") else run.peer_a2a(label))]
                for run in runs for i, (label, p) in enumerate(run.plans.items())]
        lines += ["", "At real models' proportions, each with its own top-k router (2 × 1 ranks, one core per rank, links sized from "
                  "this machine's measured FLOP/s):", "",
                  table(["run", "plan", "wall ms (p25–p75)", "compute-only ms", f"÷ {base}, paired", "÷ `peer:deepspeed_moe`, paired",
                         "all-to-all B/step (the peer: its payload)"], rows), ""]
        claim = self.claims["locmoe"]
        figures = []
        for run in runs:
            saving = 1 - run.paired("plan", base)[0]
            verdict = saving_verdict(saving, claim)
            top_k = run.d["model_kwargs"].get("top_k", "?")
            lines.append(f"- `{run.name}`: {run.model()}; {run.link_layout()}; proportions {run.proportions()}; {link_sizing(run)}; load "
                         f"{run.load()}. The defaults save {pct(saving, False)} of the step of the model's own top-{top_k} router "
                         f"without locality (paired), LocMoE's claimed saving {pct(claim['saving_low'], False)}–"
                         f"{pct(claim['saving_high'], False)} (over top-1 routers): {verdict}.")
            figures.append(f"{run.proportions()}, top-{top_k}: ÷ the model's router without locality {xr(run.paired('plan', base))} "
                           f"({verdict.removesuffix(' the claimed range')} the claimed saving), ÷ `peer:deepspeed_moe` "
                           f"{x(run.paired('plan', 'baseline')[0])}")
        change, share = self.locmoe_quality(lines, "Mixtral-8x7B", LOCMOE_MIXTRAL_QUALITY)
        lines += ["", f"- The locality gate's defaults (model scores, at most 30% of a rank's tokens off its node at top-2, balance "
                  f"1.2) cost {pct(change['model+locality'])} final loss at these proportions, for {x(share['model+locality'])}× "
                  f"the bytes across nodes; half the tokens allowed off their node, {pct(change['model+locality f0.5'])} at "
                  f"{x(share['model+locality f0.5'])}×; the balance cap with no locality limit, {pct(change['balance only'])} at "
                  f"{x(share['balance only'])}×. The loss is what keeping tokens on their node costs: an off-node cap trades "
                  "quality for bytes, and the default is the byte-saving end of it."]
        top8, top8_share = self.locmoe_quality(lines, "Qwen3-30B-A3B", LOCMOE_QWEN3_QUALITY)
        lines += ["", f"- At top-8 the defaults cost {pct(top8['model+locality'])} for {x(top8_share['model+locality'])}× the bytes; "
                  f"half the tokens off their node, {pct(top8['model+locality f0.5'])} at {x(top8_share['model+locality f0.5'])}×; "
                  f"the balance cap alone, {pct(top8['balance only'])}; GrAP, {pct(top8['grap+locality'])} at "
                  f"{x(top8_share['grap+locality'])}×. Balancing costs little; keeping tokens on their node costs the loss. "
                  "At both presets GrAP sends about as few bytes as the model's scores at a smaller loss: the lead for the "
                  "top-k default."]
        return runs, ("locality gate at " + "; ".join(figures) + f" (paired; loss {pct(change['model+locality'])} at Mixtral's, "
                      f"{pct(top8['model+locality'])} at Qwen3's)")

    def locmoe_quality(self, lines: list[str], model: str, names: tuple[str, ...]) -> tuple[dict, dict]:
        """The quality table of `benchmarks/locmoe.py` runs at a preset's own top-k (the later
        files train the same base, same seeds, bit for bit, and add routers); appends it to
        `lines`, returns each router's final-loss change and share of bytes across nodes."""
        key = "final_loss (mean of last 10% of steps)"
        q = self.src.json(names[0])
        first = next(iter(q["results"]))
        b = q["results"][first]["over_seeds"]
        results = {label: r for name in names for label, r in self.src.json(name)["results"].items()}
        change = {label: r["over_seeds"][key]["mean"] / b[key]["mean"] - 1 for label, r in results.items()}
        share = {label: r["over_seeds"]["a2a_inter_node_bytes_mean"]["mean"] / b["a2a_inter_node_bytes_mean"]["mean"] for label, r in results.items()}
        rows = [[label, f"`{r['passes']}`", x(share[label]), x(r["over_seeds"]["load_max_over_mean"]["mean"]),
                 f"{r['over_seeds'][key]['mean']:.4f} ± {r['over_seeds'][key]['stdev']:.4f} ({pct(change[label])})"]
                for label, r in results.items()]
        cfg = q["config"]
        lines += ["", f"Quality at {model}'s proportions (`benchmarks/locmoe.py --model {cfg['model']}`, "
                  + ", ".join(f"`{name}`" for name in names)
                  + f"; {cfg['steps']} steps, seeds {', '.join(map(str, cfg['seeds']))}, mean ± sd, byte vocabulary; load "
                  f"{load_cell(q.get('run'))}):", "",
                  table(["router", "passes", f"a2a across nodes ÷ {first}", "load max/mean", f"final loss (vs {first})"], rows)]
        return change, share

    def embrace(self) -> str:
        claim = self.claims["embrace"]
        runs = [self.src.bench("peers_embrace_gpt_moe_words_loss_100mbit_2x1.json"), self.src.bench("peers_embrace_gpt2_proportions_100mbit_2x1.json"),
                self.src.bench("embrace_2d_llama_words_100mbit_2x1.json")]
        rows, notes = [], []
        for run in runs:
            for label, plan in run.plans.items():
                busiest = run.busiest_link(label)
                rows.append([run.model() if label == "plan" else "″", f"`{plan['passes']}`", run.wall(label),
                             ms(run.median(label, "compute_only")), mb(busiest) if busiest else "–", xr(run.paired(label, "baseline"))])
            speed = 1 / run.paired("plan", "baseline")[0]
            below = run.median("plan") < run.median("plan", "compute_only")
            how = f"{x(speed)}× faster than DDP" if speed >= 1 else f"{x(1 / speed)}× DDP's step (slower)"
            notes.append(f"- `{run.name}`: `split_embedding_comm` {how} (paired), claimed {claim['speedup']}× faster: "
                         f"{reached(speed >= claim['speedup'])}; {run.link_layout()}; proportions {run.proportions()}; load {run.load()}."
                         + (" Its wall is below its own compute-only step: the compute-only replay ran slower than the whole "
                            "step, so neither is a floor for this run." if below else ""))
        lines = [table(["model", "plan", "wall ms (p25–p75)", "compute-only ms", "busiest link B/step", "÷ DDP, paired (p25–p75)"], rows), "", *notes]
        proj = [self.projection(f"log/2026-11-26-projection_lina_embrace_a100_{w}_{p}.txt", "lift,expert_parallel,split_embedding_comm",
                                "lift,expert_parallel") for p in ("bf16", "fp32") for w in (16, 32)]
        lines.append(f"- **Projected** on {self.world(16)} / {self.world(32)} A100s against commfx's dense all-reduce: {x(proj[0])} / {x(proj[1])} in bf16, "
                     f"{x(proj[2])} / {x(proj[3])} in fp32 ({x(1 / proj[0])}× at best): the claim is {reached(1 / min(proj) >= claim['speedup'])} "
                     "there, and the simulator leaves out the sparse exchange's own compute, so this favours EmbRace.")
        two_d = runs[2]
        lines.append(f"- `{two_d.name}` (issue 44's untied word LM: `embrace_models.py:llama_words_loss`, Zipf ids streamed, a new batch "
                     f"each step): `schedule=2d` ÷ `schedule=step` {xr(two_d.paired('plan', 'step'))} paired (target ≤ {x(1 / 1.3)}: "
                     f"{'met' if two_d.paired('plan', 'step')[0] <= 1 / 1.3 else 'not met'}); ÷ DDP {xr(two_d.paired('plan', 'baseline'))} "
                     f"(target ≤ 0.25: {'met' if two_d.paired('plan', 'baseline')[0] <= 0.25 else 'not met'}); wall "
                     f"{x(two_d.median('plan') / two_d.wire_bound('plan'))}× its wire bound max(compute, wire).")
        self.row("**EmbRace**", f"`split_embedding_comm:schedule=2d` ÷ `peer:ddp` {xr(two_d.paired('plan', 'baseline'))} paired on an untied "
                 f"50k-word LM ({reached(1 / two_d.paired('plan', 'baseline')[0] >= claim['speedup'])}); {x(runs[1].paired('plan', 'baseline')[0])} "
                 f"on GPT-2-like proportions, tied head ({reached(1 / runs[1].paired('plan', 'baseline')[0] >= claim['speedup']).strip('*')})",
                 two_d.peer(), f"{two_d.model()}, {runs[1].model()}; {two_d.proportions()}",
                 two_d.link_layout(), "measured", two_d.load(), [two_d.name, runs[1].name])
        return "\n".join(lines)

    def optimus_cc(self) -> str:
        claim = self.claims["optimus_cc"]
        real, toy = self.src.bench(OPTIMUS_CC_REAL), self.src.bench(OPTIMUS_CC_TOY)
        rows = []
        for run in (real, toy):
            uncompressed = "uncompressed" if "uncompressed" in run.plans else None
            for i, (label, p) in enumerate(run.plans.items()):
                rows.append([f"`{run.name}`" if i == 0 else "″", f"`{p['passes']}`", run.wall(label), ms(run.median(label, "compute_only")),
                             xr(run.paired(label, "baseline")), xr(run.paired(label, uncompressed)) if uncompressed else "–"])
        lines = [table(["run", "plan", "wall ms (p25–p75)", "compute-only ms", "÷ `peer:pipelining`, paired (p25–p75)",
                        "÷ uncompressed, paired"], rows), ""]
        for run in (real, toy):
            layout = run.d["plans"][0].get("layout") or {}
            lines.append(f"- `{run.name}`: {run.model()}, pp {layout.get('pp', 'not recorded')}; {run.link_layout()}; proportions "
                         f"{run.proportions()}; load {run.load()}.")
        lines.append(f"- `{real.name}`: {link_sizing(real)}, so that one stage's compute ÷ its boundary send per token is that of "
                     f"Optimus-CC's GPT-2.5B run (tp 8 × pp 4 on 8 × A100 nodes at 200 Gb/s a node: "
                     f"{proportions.pipeline_compute_over_comm(proportions.REAL_MODELS['gpt-2.5b']):.1f}, "
                     "`bench/proportions.py`); the boundary's comm-only time is "
                     f"{ms(real.median('uncompressed', 'comm_only'))} ms of an uncompressed step's {ms(real.median('uncompressed'))} ms: "
                     "at these proportions there is little for compression to save.")
        qualities = [(name, self.src.json(name)) for name in (OPTIMUS_CC_REAL_QUALITY, OPTIMUS_CC_TOY_QUALITY)]
        qrows = [[f"`{name}`" if i == 0 else "″", r["plan"], f"{r['bytes_ratio']:.1f}×", pct(r["vs_uncompressed"]) + per_seed(r),
                  "yes" if r["vs_uncompressed"] <= claim["loss_within"] else "no"]
                 for name, q in qualities for i, r in enumerate(q["rows"])]
        lines += ["", "Quality and bytes (`benchmarks/pipeline_quality.py`, pp 2 on two ranks, the model of each bench run above "
                  "with the byte vocabulary of the corpus): "
                  + "; ".join(f"`{name}` {q['args']['steps']} steps, hidden {q['args']['hidden']}, {q['args']['microbatches']} "
                              f"micro-batches, {seeds_text(q)}, load {load_cell(q.get('run'))}" for name, q in qualities) + ".", "",
                  table(["run", "plan", "fewer backward bytes", "loss vs uncompressed",
                         f"at most {pct(claim['loss_within'], False)} above"], qrows), ""]
        rows_all = [r for _, q in qualities for r in q["rows"]]
        best = max(rows_all, key=lambda r: (r["bytes_ratio"], -r["vs_uncompressed"]))  # most bytes saved, then least loss
        default = next(r for r in qualities[0][1]["rows"] if r["plan"].startswith("epilogue only, lazy"))
        lines.append(f"- {claim['bytes_fewer']}× fewer bytes ({claim['bytes_fewer_source']}) with loss at most "
                     f"{pct(claim['loss_within'], False)} above: "
                     f"{reached(best['bytes_ratio'] >= claim['bytes_fewer'] and best['vs_uncompressed'] <= claim['loss_within'])}. "
                     f"At GPT-2.5B's widths scaled the default sends {default['bytes_ratio']:.1f}× fewer backward bytes at "
                     f"{pct(default['vs_uncompressed'])} loss; the most any plan saved here, {best['bytes_ratio']:.1f}× "
                     f"({best['plan']}), at {pct(best['vs_uncompressed'])}. A rank-r send of a t × h gradient is (t + h) r numbers "
                     "for t h, so the saving grows with the width: the scaled widths cannot show the claim's ratio.")
        by_plan = {r["plan"]: r["vs_uncompressed"] for _, q in qualities for r in q["rows"]}
        if by_plan.get("compressed, lazy error propagation", 0) > by_plan.get("compressed, no error feedback", 0):
            lines.append("- Lazy error propagation costs loss when every send is compressed: the residual of one micro-batch's "
                         "activation gradient is added to the next micro-batch's, other tokens, so it does not cancel in the "
                         "weight gradients the way error feedback on a weight gradient does.")
        proj = plan_log(self.src.text("log/2026-11-26-projection_optimus_cc_a100_128_bf16.txt"))
        base = min((v for k, v in proj.items() if "compress" not in k), default=None)
        if base:
            lines.append(f"- **Projected** (GPT-2.5B's shape on {self.world(128, 'log/2026-11-26-projection_optimus_cc_a100_128_bf16.txt')} A100s, `log/2026-11-26-projection_optimus_cc_a100_128_bf16.txt`): "
                         + ", ".join(f"`{k.split(',', 2)[-1]}` {x(v / base)}" for k, v in proj.items() if "compress" in k)
                         + " of the uncompressed step.")
        toy_default = next(r for r in qualities[1][1]["rows"] if r["plan"].startswith("epilogue only, lazy"))
        self.row("**Optimus-CC**", f"default `compress_pipeline` ÷ `peer:pipelining` {xr(real.paired('plan', 'baseline'))} paired, "
                 f"÷ uncompressed {x(real.paired('plan', 'uncompressed')[0])}, at GPT-2.5B's proportions; "
                 f"{default['bytes_ratio']:.1f}× fewer backward bytes at {pct(default['vs_uncompressed'])} loss (target "
                 f"{claim['bytes_fewer']}×, commfx's own figure at hidden 1,024: {reached(default['bytes_ratio'] >= claim['bytes_fewer']).strip('*')}); "
                 "toy at 100 Mbit/s: "
                 f"÷ the peer {x(toy.paired('plan', 'baseline')[0])}, {toy_default['bytes_ratio']:.1f}× fewer bytes at "
                 f"{pct(toy_default['vs_uncompressed'])}",
                 real.peer(), "; ".join(run.model() + "; " + run.proportions() for run in (real, toy)),
                 "; ".join(run.link_layout() for run in (real, toy)), "measured", "; ".join(run.load() for run in (real, toy)),
                 [real.name, OPTIMUS_CC_REAL_QUALITY, toy.name, OPTIMUS_CC_TOY_QUALITY])
        return "\n".join(lines)

    def semi(self) -> str:
        claim = self.claims["semi"]
        run = self.src.bench("peers_semi_dtensor_tp_llama_2x1.json")
        healthy_peer = "healthy-dtensor" if "healthy-dtensor" in run.plans else None
        rows = [[f"`{p['passes']}`", "half speed" if p.get("straggler_slowed") else "none", run.wall(label),
                 xr(run.paired(label, "baseline")), xr(run.paired(label, "healthy-tp"))]
                + ([xr(run.paired(label, healthy_peer))] if healthy_peer else []) for label, p in run.plans.items()]
        peer_slowed = bool(run.plans["baseline"].get("straggler_slowed"))
        straggler = (run.d.get("straggler") or {}).get("describe", "a straggler").split(", cgroup ")[0]
        decisions = run.plans["plan"].get("resize_tp_decisions") or []
        kinds = {k: sum(1 for d in decisions if re.match(rf"step \d+: {k}\b", d)) for k in ("resize", "migrate")}
        st = self.src.json("straggler_tp.json")
        bench = Run("straggler_tp.json", st["step_time"]["bench"])
        labels = {"baseline": "no straggler", "plan": "straggler, nothing done", "resizing": "resizing only",
                  "migration": "migration only", "SEMI-migration": "SEMI-migration"}
        srows = [[name, f"`{bench.plans[label]['passes']}`", bench.wall(label), xr(bench.paired(label, "baseline")),
                  x(bench.median(label) / bench.median("baseline"))] for label, name in labels.items()]
        semi_over = bench.paired("SEMI-migration", "baseline")
        quality = {r["plan"]: r for r in st["quality"]["rows"]}
        semi_q = next(r for name, r in quality.items() if name.startswith("SEMI"))
        load = load_cell(st["run"]) if st.get("run") else load_cell(None, st["load_before"], st["load_after"], bench.d["machine"]["cpus"])
        over_healthy = run.paired("plan", "healthy-tp")
        target = claim["target_over_healthy"]
        bound = bench.balance_bound("baseline")
        peer_bound = run.balance_bound("healthy-tp")

        fast, slow = run.plans["plan"]["rank_compute_only_median_s"][:2]
        share_note = (" The CPU quota slows the rank's communication threads too." if run.d["straggler"]["method"] == "cgroup" else "")
        share_note += (f" The slow rank's compute-only step took {x(slow / fast)}× the fast rank's (a split in proportion to speed "
                       "would take 1×).")

        def against_bound(b: float) -> str:
            return (f"lossless balance bound {x(b)}×: the healthy step's communication plus its compute re-split in proportion "
                    "to the ranks' speeds" + (f"; below it, as the target of {target}× is, only resizing's dropped work reaches" if target < b else ""))
        peer_note = (f"The peer ran with the same straggler ({straggler}), in the same rounds" if peer_slowed else
                     "The peer ran **without** the straggler, so the first ratio compares a slowed plan with a healthy peer")
        lines = [table(["plan", "straggler", "wall ms (p25–p75)", "÷ `peer:dtensor_tp` (paired)", "÷ commfx tp, healthy (paired)"]
                       + (["÷ `peer:dtensor_tp`, healthy (paired)"] if healthy_peer else []), rows), "",
                 f"- `{run.name}`: {run.model()}; {run.link_layout()}; load {run.load()}. {peer_note}. SEMI's decisions: {kinds['resize']} resize, "
                 f"{kinds['migrate']} migrate. Against commfx's own healthy tp it is {x(over_healthy[0])}× (target ≤ "
                 f"{target}×: {'met' if over_healthy[0] <= target else 'not met'}; "
                 f"{against_bound(peer_bound)}).{share_note}", "",
                 f"`straggler_tp.json` (`benchmarks/straggler_tp.py`, {describe_model(bench.d['model'], {})}, {bench.link_layout()}, "
                 f"load {load}):", "",
                 table(["plan", "passes", "wall ms (p25–p75)", "÷ no straggler, paired (p25–p75)", "÷ no straggler, medians"], srows), "",
                 f"- SEMI ÷ the healthy step {x(semi_over[0])} paired (target ≤ {target}×: "
                 f"{'met' if semi_over[0] <= target else 'not met'}; {against_bound(bound)}; SEMI is "
                 f"{x(bench.median('SEMI-migration') / bench.median('baseline') / bound)} of that bound, by medians); training loss with the straggler "
                 f"{pct(semi_q['vs_no_straggler'])} against none ({(st.get('quality_args') or st['args'])['steps']} steps, one seed)."]
        self.row("**ZERO-resizing / SEMI**", f"SEMI with a half-speed rank ÷ the healthy step {x(semi_over[0])} paired "
                 f"(`straggler_tp.json`); ÷ {'`peer:dtensor_tp` with the same straggler' if peer_slowed else 'healthy `peer:dtensor_tp`'} "
                 f"{x(run.paired('plan', 'baseline')[0])}, ÷ healthy commfx tp {x(over_healthy[0])} (`{run.name}`; target ≤ "
                 f"{target}×: {'met' if max(semi_over[0], over_healthy[0]) <= target else 'not met'}; "
                 f"lossless re-balancing can reach no lower than {x(bound)} and {x(peer_bound)} there)",
                 run.peer() + ("; the peer had the same straggler" if peer_slowed else "; the peer had no straggler"),
                 f"{describe_model(bench.d['model'], {})}, {run.model()}; {(st.get('run') or {}).get('proportions') or 'not recorded'}", bench.link_layout(), "measured", load,
                 ["straggler_tp.json", run.name])
        return "\n".join(lines)

    def zero(self) -> str:
        claim = self.claims["zero"]
        runs = [self.src.bench(n) for n in ("zero_gpt_moe_quiet_1gbit_2x1.json", "zero_gpt_dense_quiet_1gbit_2x1.json",
                                            "zero3_dense_buckets_1gbit_2x1.json")]
        rows = []
        for run in runs:
            cell = lambda label: (f"{x(run.paired(label, 'baseline')[0])} [{ms(run.median(label))}]" if label in run.plans else "–")  # noqa: E731
            rows.append([run.model(), f"[{ms(run.median('baseline'))}]", cell("z1"), cell("z2"),
                         xr(run.paired("plan", "baseline")), cell("fsdp"), xr(run.paired("plan", "fsdp")), f"`{run.name}`"])
        lines = [table(["model", "replicated [ms]", "stage 1", "stage 2", "stage 3 ÷ replicated, paired", "`peer:fsdp2`",
                        "stage 3 ÷ fsdp2, paired", "JSON"], rows), "",
                 f"Ratios are paired ÷ the replicated plan, wall medians in brackets; {runs[0].link_layout()}; load {'; '.join(r.load() for r in runs)}. "
                 f"Targets: stage 3 ≤ {claim['target_over_replicated']}× replicated: "
                 + ", ".join(f"{'met' if r.paired('plan', 'baseline')[0] <= claim['target_over_replicated'] else 'not met'} "
                             f"({x(r.paired('plan', 'baseline')[0])})" for r in runs)
                 + f"; ≤ `peer:fsdp2`: " + ", ".join(f"{'met' if r.paired('plan', 'fsdp')[0] <= claim['target_over_fsdp2'] else 'not met'}"
                                                     for r in runs) + "."]
        last = runs[-1]
        if "small" in last.plans:
            chosen = int(last.plans["plan"]["compiled_with"]["choices"]["shard_states:bucket_bytes"])
            small = int(last.plans["small"]["passes"].split("bucket_bytes=")[1])
            lines.append(f"- `{last.name}`: `bucket_bytes=auto` chose {chosen:,}-byte buckets from this run's measured link and per-call cost "
                         f"(an all-gather sends half an all-reduce's bytes); {small:,}-byte buckets (the all-reduce chunk's rule, as "
                         f"`auto` chose before) ÷ replicated {xr(last.paired('small', 'baseline'))} in the same rounds. "
                         "A round ends as a training step does: stage 3's parameters stay sharded and the next forward gathers them "
                         f"(runs before `{last.name}` gathered every parameter after each step, inside the clock, and so charged "
                         f"stage 3 a serial all-gather of the model; `log/2026-11-28-zero3_dense_buckets_1gbit_2x1_a49e7e6.json`: 1.53).")
        mem = self.src.json("zero_memory_gpt_moe.json")["memory_rank0"]
        lines.append("- Memory (`zero_memory_gpt_moe.json`, rank 0's parameters, gradients and AdamW state): stage 3 ÷ replicated "
                     + ", ".join(f"{x(mem[f'dp={dp} lift,shard_states:stage=3']['total'] / mem[f'dp={dp} lift']['total'])} at dp {dp}"
                                 for dp in (2, 4)) + ".")
        self.row("**ZeRO**", f"stage 3 ÷ replicated {xr(last.paired('plan', 'baseline'))}, ÷ `peer:fsdp2` "
                 f"{x(last.paired('plan', 'fsdp')[0])} paired (target ≤ {claim['target_over_replicated']}×: "
                 f"{'met' if last.paired('plan', 'baseline')[0] <= claim['target_over_replicated'] else 'not met'})",
                 last.peer("fsdp"), last.model() + "; " + last.proportions(), last.link_layout(), "measured", last.load(), [last.name])
        return "\n".join(lines)

    def compute(self) -> str:
        c = self.src.json("compute_world1.json")
        record = c.get("run")
        names = ("eager", "torch.compile", "commfx-interpret", "commfx-inductor")
        rows = [[r["model"], *(f"{r['median_ms'][n]:,.0f} ({x(r['ratio_to_compile'][n])})" for n in names),
                 f"{x(r['median_ms']['commfx-inductor'] / r['median_ms']['eager'])}"] for r in c["results"]]
        worst = max(r["ratio_to_compile"]["commfx-inductor"] for r in c["results"])
        worst_eager = max(r["median_ms"]["commfx-inductor"] / r["median_ms"]["eager"] for r in c["results"])
        lines = [f"One rank, no communication: AdamW training steps of each model, eager PyTorch and torch.compile (Inductor) of "
                 f"the plain model against commfx's `{c['results'][0]['passes']}` interpreted and with compiled regions, in "
                 f"interleaved rounds ({c['results'][0]['rounds'] - c['results'][0]['warmup']} measured after "
                 f"{c['results'][0]['warmup']} warm-ups; torch {c['torch']}, {c['threads']} threads; `benchmarks/compute_world1.py`, "
                 "`compute_world1.json`). Cells: median ms (÷ torch.compile, the median of per-round ratios).", "",
                 table(["model", "eager", "torch.compile", "commfx interpreted", "commfx compiled", "compiled ÷ eager"], rows), "",
                 "- Models: " + "; ".join(f"{r['model']}: " + ", ".join(f"{k} {v}" for k, v in r["config"].items()) for r in c["results"]) + "."]
        self.row("**Compute, one rank**", f"commfx compiled ÷ torch.compile ≤ {x(worst)}, ÷ eager ≤ {x(worst_eager)} "
                 f"(target ≤ 1.05 and ≤ 1.00: {'met' if worst <= 1.05 and worst_eager <= 1.0 else 'not met'})",
                 "eager and torch.compile, same rounds", (record or {}).get("proportions") or "not recorded", "one rank, CPU",
                 "measured", load_cell(record), ["compute_world1.json"])
        return "\n".join(lines)

    def gpu_step(self) -> str:
        g = self.src.json("gpu_step_h200.json")
        v, record = g["variants"], g["run"]
        ours, compiled, eager = v["commfx"], v["inductor"], v["eager"]
        budget = g["commfx_activation_memory_budget"]["0.5"]
        model = ", ".join(f"{k} {val}" for k, val in g["model"].items())
        rows = [[name, f"{r['median_ms']:.1f}", f"{r['peak_gib']:.2f}"] for name, r in (
            ("eager, autocast", eager), ("torch.compile, autocast", compiled), ("commfx, compiled regions", ours),
            ("commfx, `compute=\"interpret\"`", g["commfx_interpret"]), ("commfx, `activation_memory_budget=0.5`", budget))]
        fp32 = g["losses_12_steps_batch_4x512"]
        drift = max(abs(a - b) for a, b in zip(fp32["inductor fp32"], fp32["eager fp32"]))
        lines = [f"{g['gpu']}, torch {g['torch']}; {model} (`gpu_step_h200.json`, assembled from the two device logs it names).", "",
                 table(["variant", "median step ms", "peak GiB"], rows), "",
                 f"- commfx ÷ torch.compile {x(ours['median_ms'] / compiled['median_ms'])}, ÷ eager {x(ours['median_ms'] / eager['median_ms'])} "
                 f"(target ≤ 1: met). Peak memory ÷ eager {x(ours['peak_gib'] / eager['peak_gib'])} by default (target ≤ 1.05: not met), "
                 f"{x(budget['peak_gib'] / eager['peak_gib'])} with `activation_memory_budget=0.5` (met, at {budget['median_ms']:.1f} ms).",
                 f"- Same function: step-0 loss {g['step0']['commfx_loss']:.5f} against eager's {g['step0']['eager_loss']:.5f}; over 12 float32 "
                 f"AdamW steps the losses agree to {drift:.0e}; in bf16 they part by rounding (the JSON's `losses_12_steps_batch_4x512`)."]
        self.row("**Compute, one H200**", f"commfx ÷ torch.compile {x(ours['median_ms'] / compiled['median_ms'])}, ÷ eager "
                 f"{x(ours['median_ms'] / eager['median_ms'])}; peak memory ÷ eager {x(ours['peak_gib'] / eager['peak_gib'])} "
                 f"({x(budget['peak_gib'] / eager['peak_gib'])} with budget 0.5)", "eager and torch.compile, same process",
                 record["proportions"], f"one {g['gpu']}", "measured", load_cell(record), ["gpu_step_h200.json"])
        return "\n".join(lines)

    def gpu_kernels(self) -> str:
        g = self.src.json("gpu_kernels_h200.json")
        rows = [[r["kernel"], f"{r['ms']:.3f}", f"{r['floor_ms']:.3f}", x(r["floor_ms"] / r["ms"])] for r in g["rows"]]
        by = {r["kernel"]: r for r in g["rows"]}
        share = lambda name: by[name]["floor_ms"] / by[name]["ms"]  # noqa: E731
        forward, library = share("grouped GEMM (up proj) · commfx grouped_mm"), share("grouped GEMM · torch._grouped_mm")
        ran = share("weight grad · commfx grouped_mm_weight_grad")
        now = share("weight grad · torch._grouped_mm, row-major [E, N, K] out")
        record = g.get("run") or {}
        lines = [f"{g['card']}, torch {g['torch']}, Triton {g['triton']}; ceilings measured in the same run: copy "
                 f"{g['ceilings']['copy_GBps']:,.0f} GB/s, bf16 matmul {g['ceilings']['bf16_TFLOPs']:,.0f} TFLOP/s "
                 "(`benchmarks/gpu_kernels.py`, `gpu_kernels_h200.json`; shapes from Mixtral-8x7B's experts, see the script).", "",
                 table(["kernel", "ms", "floor ms", "floor ÷ time"], rows), "",
                 f"- The forward runs cuBLAS's grouped GEMM at {x(forward)} of the bf16 floor (`torch._grouped_mm` alone: "
                 f"{x(library)}); target ≥ 0.85.",
                 f"- Weight gradient: the code this run measured reached {x(ran)}: {record.get('code', '')}. The row-major "
                 f"kernel alone reaches {x(now)}. One GPU: no collective crossed GPUs."]
        self.row("**GPU kernels**", f"grouped GEMM at {x(forward)} of the bf16 floor, weight gradient {x(ran)} as run "
                 f"({x(now)} for the kernel now called)", "`torch._grouped_mm`, cuBLAS loop, torch ops; same run",
                 record.get("proportions") or "Mixtral-8x7B expert shapes (proportions not recorded)", f"one {g['card']}",
                 "measured", load_cell(record), ["gpu_kernels_h200.json"])
        return "\n".join(lines)

    def simulator(self) -> str:
        p = self.src.json("prediction_error_emulated.json")
        s = p["summary"]
        ranking = self.src.json("plan_ranking_emulated.json")
        ranking = ranking["rows"] if isinstance(ranking, dict) else ranking
        rows = [[r["run"], r["candidates"], f"{x(r['chosen_over_best_measured'])}",
                 "yes" if r["predicted_order"] == r["measured_order"] else "no"] for r in ranking]
        runs = sorted({c["run"] for c in p["comparisons"]})
        within = re.search(r"within_(\d+)_percent", " ".join(s)).group(1)  # the threshold the JSON's own key names
        fitted = s["fitted_runs"]
        automatic = [c for c in p["comparisons"] if c["choices"]]
        own = sum(1 for c in automatic if "not recorded" not in c["figures"])
        lines = [f"`benchmarks/prediction_error.py` (`prediction_error_emulated.json`): {s['plans']} commfx plans of {len(runs)} runs "
                 f"simulated on the `emulated` preset. Of the {len(automatic)} with automatic choices (k=auto and the like), {own} "
                 f"compiled with the cost models' figures their run compiled with; {s['choices_checked']} had their choices checked "
                 f"against the run's, the runs of {s['choices_not_recorded']} did not record theirs. Step error median {pct(s['step_error_median'], False)}, worst "
                 f"{pct(s['step_error_worst'], False)}, {s['within_15_percent']} within {within}%; ratio to the run's first plan, "
                 f"median {pct(s['ratio_error_median'], False)} off, worst {pct(s['ratio_error_worst'], False)}. Out of sample: "
                 f"the {len(fitted)} cited runs the preset was fitted to (its `fitted_to`, `src/commfx/clusters/emulated.toml`: "
                 + ", ".join(f"`{name}`" for name in fitted) + ") are left out"
                 + (f"; {s['mismatched_runs']} more because the simulator did not make their automatic choices." if s["mismatched_runs"] else "."),
                 "",
                 "`benchmarks/plan_ranking.py` (`plan_ranking_emulated.json`): the search's first choice against the best measured plan:", "",
                 table(["run", "candidates", "first choice ÷ best measured", "order right"], rows)]
        self.row("**Simulator**", f"step error median {pct(s['step_error_median'], False)}, worst {pct(s['step_error_worst'], False)} "
                 f"over {s['plans']} plans of runs the preset was not fitted to", "the runs' own measurements", "each run's", "`emulated` preset at each run's",
                 "projected against measured", "not recorded", ["prediction_error_emulated.json", "plan_ranking_emulated.json"])
        return "\n".join(lines)

    def other(self) -> str:
        hier = self.src.bench("hierarchical_a2a_gpt_moe_2x2_1gbit_1ms.json")
        part = self.src.bench("machine_measured_partition_100mbit_2x1.json")
        fp8 = self.src.json("fp8_dispatch_quality.json")["results"]
        key = "final_loss (mean of last 10% of steps)"
        fp8_loss = fp8["fp8 dispatch"]["over_seeds"][key]["mean"] / fp8["bf16 dispatch"]["over_seeds"][key]["mean"] - 1
        fp8_bytes = fp8["fp8 dispatch"]["over_seeds"]["a2a_bytes_per_step"]["mean"] / fp8["bf16 dispatch"]["over_seeds"]["a2a_bytes_per_step"]["mean"]
        chosen = next((c.split(":", 1)[1].split(" chunks")[0].strip() for c in part.plans["plan"].get("choices") or [] if c.startswith("partition_a2a")), "not recorded")
        rows = [
            ["`hierarchical_a2a:enabled=auto` ÷ flat all-to-all", xr(hier.paired("plan", "baseline")), hier.link_layout(), hier.load(),
             f"`{hier.name}`"],
            ["`hierarchical_a2a` (every all-to-all) ÷ flat", x(hier.median("always") / hier.median("baseline")) + " (medians)",
             "″", "same run", f"`{hier.name}`"],
            ["fp8 dispatch ÷ bf16: final loss, all-to-all bytes", f"{pct(fp8_loss)}, {x(fp8_bytes)}×", "2 ranks, one process group",
             "not recorded", "`fp8_dispatch_quality.json`"],
            [f"`partition_a2a` (k chosen: {chosen}) ÷ naive, machine measured", xr(part.paired("plan", "baseline"))
             + "".join(f"; `{part.plans[label]['passes'].rsplit(',', 1)[1]}` in the same rounds {xr(part.paired(label, 'baseline'))}"
                       for label in part.plans if label not in ("plan", "baseline")), part.link_layout(),
             part.load(), f"`{part.name}`"],
        ]
        sites = ((hier.plans["plan"].get("compiled_with") or {}).get("choices") or {}).get("hierarchical_a2a:enabled", "not recorded")
        return "\n".join([table(["figure", "value (paired, p25–p75)", "link, layout", "load", "JSON"], rows), "",
                          f"`hierarchical_a2a:enabled=auto` compiled, from the run's measured figures: {sites.replace(',', ', ')}. "
                          "Where it chose flat everywhere it runs the baseline's algorithm, and the ratio is the spread of 4 ranks "
                          "on 2 cores.", "",
                          "bf16 steps are timed on the H200 (above), not here: this CPU (AVX2, no bf16 units) multiplies bf16 "
                          "matrices about 60× slower than float32 (`log/2026-11-28-bf16-on-this-cpu.md`), so a bf16 "
                          "figure from it measures the CPU, not the plan."])

    def unrecorded(self) -> str:
        groups: dict[tuple[str, ...], list[str]] = {}
        for name, data in sorted(self.src.cache.items()):
            if name.endswith(".json"):
                groups.setdefault(tuple(missing_fields(data)), []).append(name)
        lines = [f"Runs from before the run record (`src/commfx/bench/run_record.py`) lack some of: {', '.join(RUN_FIELDS)}. "
                 f"A run is marked **loaded** above {run_record.LOADED_PER_CORE} of load average per core."]
        for missing, names in sorted(groups.items()):
            what = ", ".join(missing) if missing else "nothing"
            lines.append(f"- Not recorded: {what}: " + ", ".join(f"`{n}`" for n in names) + ".")
        return "\n".join(lines)

    def legend(self) -> str:
        return ("Figure: plan ÷ peer (or baseline) step time, the median of per-round ratios of plans timed in the same "
                "interleaved rounds, with p25–p75 (< 1: the plan is faster). Model: what the JSON records; proportions: the "
                "`--proportions` preset or toy, as recorded (older runs: not recorded, with the preset their model kwargs match). "
                "Load: 1-minute load average at the run's start → end. Claims are the seeds' own (`claims.json`); "
                "\"projected\" rows come from the simulator, not from a run.")

    def render(self) -> str:
        sections = {name: getattr(self, name)() for name in ("lina", "locmoe", "embrace", "optimus_cc", "semi", "zero",
                                                              "compute", "gpu_step", "gpu_kernels", "simulator", "other")}
        sections["unrecorded"] = self.unrecorded()
        sections["legend"] = self.legend()
        sections["headline"] = table(["row", "figure", "peer", "model; proportions", "link; layout", "measured or projected",
                                      "load", "JSON"], self.headline)
        template = TEMPLATE.read_text()
        check_template(template)
        page = re.sub(r"\{\{(\w+)\}\}", lambda m: sections[m.group(1)], template)
        for name in self.src.cache:
            if not (HERE / name).exists():
                raise FileNotFoundError(name)
        return page


def check_template(text: str) -> None:
    """The template's prose holds no figures: every number comes from a JSON through this script."""
    prose = re.sub(r"`[^`]*`|\{\{\w+\}\}|<!--.*?-->|\]\([^)]*\)", "", text, flags=re.S)
    numbers = re.findall(r"(?<![\w\-./])\d[\d.,]*", prose)
    if numbers:
        raise ValueError(f"RESULTS.template.md states figures of its own: {numbers}; take them from a JSON instead")


def build() -> str:
    page = Report().render()
    lines = page.splitlines()
    if len(lines) > MAX_LINES:
        raise ValueError(f"RESULTS.md would be {len(lines)} lines, over {MAX_LINES}")
    if not any(line.startswith("| row |") for line in lines[:HEADLINE_BY_LINE]):
        raise ValueError(f"the headline table must start within the first {HEADLINE_BY_LINE} lines")
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff when RESULTS.md differs from what is generated")
    args = parser.parse_args(argv)
    page = build()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), page.splitlines(True),
                                                       "RESULTS.md (committed)", "RESULTS.md (generated)"))
            print("\nRESULTS.md is stale: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
