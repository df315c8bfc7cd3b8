"""Pipeline plans in the simulator: stages, micro-batches, boundary traffic and compression.

Each stage's graph becomes a one-micro-batch workload (`workload.build_workload` on the
stage, the batch cut as `pipeline_split:microbatches` cuts it), and the one-rank engine
times its forward and its backward, collectives inside the stage included (expert
all-to-alls, tensor-parallel all-reduces). The runtime's own schedule
(`runtime.pipeline.schedule.actions`) is then replayed across the stages as
`PipelineModule.step` runs it: a forward waits for its activations, a backward for its
gradients; each stage sends on one lane per direction in micro-batch order; a send crosses
the link between the two stages' ranks (shared by every pipeline whose neighbours sit on
the same two nodes). A boundary with a `compress_pipeline` codec sends the codec's own
payload (`LowRankCodec.payload_specs`) on the sends it compresses
(`critical_backwards`) and pays its PowerSGD products on both ends.

After the schedule every stage reduces its gradients over its data-parallel group (the
engine's bucketed all-reduce; a stage with a `dp_codec` sends PowerSGD factors for the
gradients it compresses) and steps its optimizer. The step ends when the slowest stage
has. Exposed communication is the step minus the same schedule with free transfers and
no gradient reduction (so the pipeline bubble is not counted as communication).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.fx as fx

from ..compiler.program import Program
from ..cost.flops import hint
from ..plan import Plan
from ..runtime.pipeline.schedule import actions, critical_backwards
from ..runtime.trace import ComputeSpan, Timeline
from .cluster import Cluster
from .collectives import link_load
from .engine import Result, Simulation
from .workload import Item, Workload, build_workload


@dataclass
class StageCost:
    """One stage's figures for one micro-batch, and its step's tail."""

    forward_s: float
    backward_s: float
    sync_s: float  # gradient reduction and optimizer step after the schedule (stage 3: the gather before it too)
    sync_compute_s: float  # the optimizer's and the dp codec's compute in it
    compute_s: float  # forward + backward compute of one micro-batch (no waits)
    activation_bytes: float  # kept for one micro-batch in flight
    memory: dict[str, float]
    inter_bytes: float = 0.0  # this stage's in-stage and sync collectives, per node link
    intra_bytes: float = 0.0
    collectives: int = 0
    history: list = field(default_factory=list)


@dataclass
class Transfer:
    """One boundary's sends of one micro-batch, each way."""

    forward_s: float
    backward_s: float  # exact
    compressed_s: float  # through the codec (== backward_s without one)
    forward_bytes: float
    backward_bytes: float
    compressed_bytes: float
    sharing: int = 0  # ranks whose sends across this boundary share one node's link; 0: inside a node
    encode_s: float = 0.0  # the codec's products on the sender of gradients
    decode_s: float = 0.0  # and on their receiver
    codec: object = None  # the boundary's (LowRankCodec.compresses says which sends it squeezes)

    def squeezes(self, critical: bool) -> bool:
        return self.codec is not None and self.codec.compresses(critical)


def simulate_pipeline(program: Program, plan: Plan, cluster: Cluster, tokens: int, scale: float) -> tuple[Result, list[str]]:
    """The step of a split program: (result, notes). `tokens`/`scale` as `build_workload`
    takes them, for the rank's whole batch."""
    pipeline = program.regions.pipeline
    stages, count, schedule = len(pipeline.stages), pipeline.microbatches, pipeline.schedule
    dtype = "bf16" if plan.precision == "bf16" else "fp32"
    costs = [_stage_cost(program, stage, plan, cluster, tokens / count, scale / count, dtype) for stage in pipeline.stages]
    transfers = [_transfer(program, b, plan, cluster, scale / count, dtype) for b in pipeline.boundaries]
    timed = _replay(schedule, costs, transfers, count)
    free = _replay(schedule, costs, [_free(t) for t in transfers], count)
    ends = [end + cost.sync_s for end, cost in zip(timed.ends, costs)]
    ideal = max(end + cost.sync_compute_s for end, cost in zip(free.ends, costs))  # free transfers, no reduction
    step = max(ends)
    slowest = ends.index(step)
    compute = count * costs[slowest].compute_s + costs[slowest].sync_compute_s
    reduction = costs[slowest].sync_s - costs[slowest].sync_compute_s
    memory = _peak_memory(costs, schedule, stages, count)
    inter, intra, sends = _boundary_bytes(transfers, schedule, stages, count)
    timeline = _timeline(timed, plan)
    result = Result(
        step, compute, _busy(timed) + reduction, step - ideal, max(c.inter_bytes for c in costs) + inter,
        max(c.intra_bytes for c in costs) + intra, max(c.collectives for c in costs) + timed.sends,
        memory, timeline, [h for c in costs for h in c.history], sends,
    )
    notes = [
        f"pipeline: {stages} stages, {schedule}, {count} micro-batches; stage {slowest} ends last; "
        f"bubble {max(free.ends) - count * max(c.compute_s for c in costs):.4g} s with free transfers; "
        f"boundary bytes per step {sends:.4g} (every boundary, both ways)",
    ]
    return result, notes


# ---------------------------------------------------------------------- one stage


def stage_program(program: Program, stage) -> Program:
    """A program whose graph is a copy of `stage`'s (regions and runtime needs shared), so
    the workload reader and the schedule pass can run on it."""
    graph = fx.Graph(tracer_cls=stage.gm.graph._tracer_cls)
    out = graph.graph_copy(stage.gm.graph, {})
    graph.output(out)
    gm = fx.GraphModule(stage.gm, graph, stage.gm.__class__.__name__)
    return replace(program, gm=gm, parent=None)


def _stage_cost(program: Program, stage, plan: Plan, cluster: Cluster, tokens: float, scale: float, dtype: str) -> StageCost:
    from ..passes.schedule.overlap import overlap_collectives

    view = stage_program(program, stage)
    overlap_collectives(view.gm)  # the lowering schedules each stage's collectives so too
    workload = build_workload(view, plan, tokens, scale)
    forward = [i for i in workload.items if i.phase == "forward"]
    backward = [i for i in workload.items if i.phase == "backward" and i.what != "grads"]
    timed_forward = _engine(view, plan, cluster, forward)
    timed_backward = _engine(view, plan, cluster, backward)
    compute = sum(cluster.device.op_seconds(i.flops, i.nbytes, dtype) for i in forward + backward if i.what == "compute")
    reduced = _sync_params(workload, stage)
    sync = _engine(view, plan, cluster, _sync_items(workload, stage, reduced), params=reduced)
    whole = _engine(view, plan, cluster, [], params=workload.params)  # the parameters as held, for memory and gathers
    memory = whole._memory()
    gathered = 0.0
    if sync.zero == 3:  # shard_states:stage=3 gathers the stage's buckets once, before the first micro-batch
        gathered = whole._wait_all(whole._gather(whole._buckets(), 1, 0.0), 0.0)
        sync.zero = 2
    sync_result = sync.run()
    f, b = timed_forward.run(), timed_backward.run()
    return StageCost(
        forward_s=f.step_s, backward_s=b.step_s, sync_s=sync_result.step_s + gathered, sync_compute_s=sync_result.compute_s,
        compute_s=compute, activation_bytes=workload.activation_bytes, memory=memory,
        inter_bytes=f.inter_node_bytes + b.inter_node_bytes + sync_result.inter_node_bytes,
        intra_bytes=f.intra_node_bytes + b.intra_node_bytes + sync_result.intra_node_bytes,
        collectives=f.collectives + b.collectives + sync_result.collectives, history=f.history + b.history + sync_result.history,
    )


def _engine(view: Program, plan: Plan, cluster: Cluster, items: list[Item], params: dict | None = None) -> Simulation:
    """The one-rank engine on a part of a stage's step (`params`: the parameters it reduces)."""
    simulation = Simulation(Workload(items, params or {}, 0.0, []), view, plan, cluster)
    if params is None:
        simulation.zero = 0  # a part of the step: parameters gathered once per step, below
    return simulation


def _sync_params(workload: Workload, stage) -> dict:
    """The stage's parameters as the reduction after the schedule sees them: a gradient the
    stage's dp codec compresses goes as its two factors."""
    codec = stage.dp_codec
    if codec is None:
        return dict(workload.params)
    out = {}
    for name, (numel, size, group) in workload.params.items():
        shape = _param_shape(stage, name)
        if group == "dp" and shape is not None and codec.compresses(shape, torch.float32):
            rows, cols = shape[-2], math.prod(shape) // shape[-2]
            numel = codec.rank * (rows + cols)
        out[name] = (numel, size, group)
    return out


def _param_shape(stage, name: str):
    try:
        return tuple(stage.gm.get_parameter(name).shape)
    except AttributeError:
        return None


def _sync_items(workload: Workload, stage, reduced: dict) -> list[Item]:
    """Gradients ready at once (the schedule has ended), the dp codec's products (on the
    `reduced` sizes, `_sync_params`), the step."""
    items = [Item("grads", "grads", "backward", params=list(workload.params))]
    codec = stage.dp_codec
    if codec is not None:
        flops = sum(6.0 * codec.rank * n for n, _, g in reduced.values() if g == "dp")
        items.append(Item("compute", "dp_powersgd", "backward", label="PowerSGD dp factors", flops=flops))
    return items + [i for i in workload.items if i.phase == "optimizer"]


# ---------------------------------------------------------------------- boundaries


def _transfer(program: Program, boundary, plan: Plan, cluster: Cluster, scale: float, dtype: str) -> Transfer:
    """One micro-batch's sends across `boundary`: forward activations, backward gradients
    (exact and through the codec), on the link between the two stages' ranks."""
    values = _values(program.regions.pipeline.stages[boundary.index])
    specs = [_spec(values[t.name], scale) for t in boundary.tensors]
    grads = [s for s, t in zip(specs, boundary.tensors) if t.requires_grad]
    forward = sum(_nbytes(s) for s in specs)
    backward = sum(_nbytes(s) for s in grads)
    codec = boundary.codec
    compressed, encode, decode = backward, 0.0, 0.0
    if codec is not None:
        compressed = sum(_nbytes(s) for s in codec.payload_specs(grads, True))
        flops = sum(2.0 * math.prod(codec.matrix_shape(shape)) * codec.factor_rank(shape) for shape, _ in grads)
        # P = M Q, Q = Mᵀ P and the residual (P's orthogonalisation is r² n, small beside them);
        # eager torch ops, not graph nodes: one launch each side
        encode = cluster.device.op_seconds(3 * flops, 4 * backward, dtype)
        decode = cluster.device.op_seconds(flops, backward, dtype)  # P Qᵀ
    sharing = _sharing(boundary.index, plan)
    seconds = [_p2p_seconds(boundary.index, nbytes, sharing, plan, cluster) for nbytes in (forward, backward, compressed)]
    return Transfer(*seconds, forward, backward, compressed, sharing, encode, decode, codec)


def _values(stage) -> dict[str, torch.Tensor]:
    """The traced values of a stage's graph by node name (what it sends on is among them:
    computed there or received and forwarded)."""
    out = {}
    for node in stage.gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            out[node.name] = value
    return out


def _spec(value: torch.Tensor, scale: float) -> tuple[torch.Size, torch.dtype]:
    """A boundary value's shape for one micro-batch (its traced shape, rows scaled)."""
    shape = [hint(s) for s in value.shape]
    if shape:
        shape[0] = max(1, round(shape[0] * scale))
    return torch.Size(shape), value.dtype


def _nbytes(spec) -> float:
    shape, dtype = spec
    return float(math.prod(shape) * dtype.itemsize)


def _sharing(index: int, plan: Plan) -> int:
    """How many ranks of stage `index`'s node send to a neighbour on another node across
    that boundary (every pipeline sends at once); 0 when the neighbours share a node."""
    topology = plan.topology
    pipelines = topology.process_groups()["pp"]
    node = topology.node_of(pipelines[0][index])
    return sum(1 for g in pipelines if topology.node_of(g[index]) == node and topology.node_of(g[index + 1]) != node)


def _p2p_seconds(index: int, nbytes: float, sharing: int, plan: Plan, cluster: Cluster) -> float:
    """Stage `index` to `index + 1` (or back), sharing the node's link with `sharing` pipelines' sends."""
    first = plan.topology.process_groups()["pp"][0]
    load = link_load("send", nbytes, [first[index], first[index + 1]], plan.topology, cluster)
    return load.latency(cluster) + load.seconds(cluster, 1.0 / max(sharing, 1))


def _boundary_bytes(transfers: list[Transfer], schedule: str, stages: int, count: int) -> tuple[float, float, float]:
    """(the busiest node link's bytes in its busier direction, one rank's intra-node bytes,
    every boundary's bytes both ways) per step."""
    inter = intra = total = 0.0
    for s, t in enumerate(transfers):
        critical = critical_backwards(schedule, s + 1, stages, count)
        forward = t.forward_bytes * count
        backward = sum(t.compressed_bytes if t.squeezes(mb in critical) else t.backward_bytes for mb in range(count))
        total += forward + backward
        if t.sharing:
            inter = max(inter, t.sharing * max(forward, backward))
        else:
            intra += forward + backward
    return inter, intra, total


def _free(transfer: Transfer) -> Transfer:
    return replace(transfer, forward_s=0.0, backward_s=0.0, compressed_s=0.0)


# ---------------------------------------------------------------------- the schedule


@dataclass
class Replay:
    ends: list[float]  # each stage's end of schedule (its last send done)
    spans: list[list[tuple[str, float, float, bool]]]  # per stage: (what, start, end, waiting)
    sends: int = 0
    wire: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each transfer


def _replay(schedule: str, costs: list[StageCost], transfers: list[Transfer], count: int) -> Replay:
    """Every stage's actions in order, each once its input has arrived; stage s's sends are
    offered on its lane and travel when the neighbour posts the matching receive."""
    stages = len(costs)
    order = [actions(schedule, s, stages, count) for s in range(stages)]
    critical = [critical_backwards(schedule, s, stages, count) for s in range(stages)]
    done = [0] * stages
    clock = [0.0] * stages
    lane_free: dict[tuple[int, str], float] = {}
    offered: dict[tuple[str, int, int], tuple[tuple[int, str], float, float]] = {}  # -> (lane, ready, seconds)
    replay = Replay([0.0] * stages, [[] for _ in range(stages)])
    while any(done[s] < len(order[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while done[s] < len(order[s]):
                action = order[s][done[s]]
                needs = None
                if action.kind == "F" and s > 0:
                    needs = ("F", s, action.microbatch)
                if action.kind == "B" and s < stages - 1:
                    needs = ("B", s, action.microbatch)
                if needs is not None and needs not in offered:
                    break
                start = clock[s] if needs is None else _receive(replay, lane_free, offered[needs], clock[s])
                if start > clock[s]:
                    replay.spans[s].append(("wait", clock[s], start, True))
                cost = costs[s].forward_s if action.kind == "F" else costs[s].backward_s
                if action.kind == "B" and s < stages - 1 and transfers[s].squeezes(action.microbatch in critical[s + 1]):
                    cost += transfers[s].decode_s
                squeezed = action.kind == "B" and s > 0 and transfers[s - 1].squeezes(action.microbatch in critical[s])
                if squeezed:
                    cost += transfers[s - 1].encode_s
                end = start + cost
                replay.spans[s].append((f"{action}", start, end, False))
                clock[s] = end
                if action.kind == "F" and s < stages - 1:
                    offered[("F", s + 1, action.microbatch)] = ((s, "F"), end, transfers[s].forward_s)
                if action.kind == "B" and s > 0:
                    t = transfers[s - 1]
                    seconds = t.compressed_s if squeezed else t.backward_s
                    offered[("B", s - 1, action.microbatch)] = ((s, "B"), end, seconds)
                done[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the pipeline schedule replay is stuck: a stage waits on a send no stage makes")
    for s in range(stages):
        replay.ends[s] = max([clock[s]] + [t for (stage, _), t in lane_free.items() if stage == s])
    return replay


def _receive(replay: Replay, lane_free: dict, offer: tuple, posted: float) -> float:
    """When a send arrives: it starts once the sender has it, the sender's lane is free and
    the receiver has posted its receive (gloo and NCCL move a large message only then)."""
    lane, ready, seconds = offer
    start = max(ready, lane_free.get(lane, 0.0), posted)
    end = lane_free[lane] = start + seconds
    replay.sends += 1
    if seconds:
        replay.wire.append((start, end))
    return end


def _busy(replay: Replay) -> float:
    """Time at least one boundary transfer was on the wire."""
    busy, reach = 0.0, 0.0
    for start, end in sorted(replay.wire):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def _peak_memory(costs: list[StageCost], schedule: str, stages: int, count: int) -> dict[str, float]:
    """The stage holding most: its parameters and states, and its activations of every
    micro-batch in flight at once (1F1B: stages - s of them; GPipe: all)."""
    best: dict[str, float] = {}
    for s, cost in enumerate(costs):
        in_flight = count if schedule == "gpipe" else min(stages - s, count)
        memory = {**cost.memory, "activations": cost.activation_bytes * in_flight}
        memory["total"] = sum(v for k, v in memory.items() if k != "total")
        if memory["total"] > best.get("total", -1.0):
            best = memory
    return best


class StageTimelines:
    """The simulated step as a trace: one process per stage (its first pipeline's rank), its
    forwards, backwards and waits (boundary transfers show as the waits they cause; the
    stages' own collectives were timed apart, per micro-batch, and are left out)."""

    def __init__(self, timelines: list[Timeline]):
        self.timelines = timelines

    @property
    def spans(self) -> list[ComputeSpan]:
        return [span for timeline in self.timelines for span in timeline.spans]

    def write(self, path, collectives) -> None:
        events = [e for t in self.timelines for e in t.chrome_events([])]
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _timeline(replay: Replay, plan: Plan) -> StageTimelines:
    ranks = plan.topology.process_groups()["pp"][0]
    end = max(replay.ends) if replay.ends else 0.0
    timelines = []
    for s, spans in enumerate(replay.spans):
        timeline = Timeline(ranks[s])
        timeline.spans = [ComputeSpan(what, "wait" if waiting else f"stage {s}", "pipeline", start, stop, waiting) for what, start, stop, waiting in spans]
        timeline.step(0, 0.0, end)
        timelines.append(timeline)
    return StageTimelines(timelines)
