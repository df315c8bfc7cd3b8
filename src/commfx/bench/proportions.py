"""Bench models with real proportions, and the emulated link that keeps a real cluster's
balance of compute and communication.

A figure measured on a toy-proportioned model says little: how much an all-to-all matters
depends on the ratio of expert width to model width, on top-k and on the expert count. So
`commfx bench --proportions NAME` builds the built-in gpt-moe scaled down from a real
config (`REAL_MODELS`: same expert count, top-k, expert-to-model width ratio and
vocabulary-to-width ratio; narrower and shallower so it runs here) and, with
`--inter-node auto`, picks the emulated link rate at which one MoE layer's compute time ÷
its inter-node all-to-all time equals that of the real model on the stated GPU cluster
(`ClusterSpec`, default 8 x H100 per node, 400 Gb/s per node):

    ratio = (FLOPs per token-layer ÷ effective FLOP/s) ÷ (all-to-all bytes per token-layer
            that cross nodes ÷ inter-node bytes/s per device)

computed for the real model on the real cluster, then solved for the emulated rate with
the scaled model, float32 rows and this machine's FLOP/s per rank (`--flops-per-rank`, or
`commfx bench --calibrate`). Attention and the MoE block's matmuls count; element-wise
work, the embedding and the head do not (the same on both sides, and small).

A dense model trained pipelined (`gpt-2.5b`, Optimus-CC's) is matched on its pipeline
boundary instead (`PipelineSpec`, `pipeline_compute_over_comm`): one stage's compute for a
token ÷ the time that token's activation takes to cross the boundary to the next node,
for the real run (its stages, tensor parallel inside a node) and for the scaled model on
`--pp` bench nodes, two layers a stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RealModel:
    """The proportions of a released MoE model (its published config)."""

    name: str
    hidden: int
    expert_hidden: int  # one expert's intermediate size
    experts: int
    top_k: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    source: str
    bench_hidden: int = 128  # the width `scaled` narrows it to by default

    @property
    def dense(self) -> bool:
        """One expert taken by every token: a dense MLP, the model is matched on its pipeline."""
        return self.experts == 1

    def flops_per_token_layer(self) -> float:
        """Forward and backward FLOPs of one token through one MoE layer: attention's four
        projections (grouped-query k/v) and top-k gated experts (three matrices each)."""
        q_o = 2 * 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * 2 * self.hidden * self.kv_heads * self.head_dim
        experts = 2 * 3 * self.hidden * self.expert_hidden * self.top_k
        return 3.0 * (q_o + k_v + experts)

    def a2a_bytes_per_token_layer(self, element_bytes: int) -> float:
        """Dispatch and combine rows, forward and backward: 4 x top-k rows of `hidden`."""
        return 4.0 * self.top_k * self.hidden * element_bytes


REAL_MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel("mixtral-8x7b", 4096, 14336, 8, 2, 32000, 32, 8, 128, 32, "mistralai/Mixtral-8x7B-v0.1 config.json"),
        RealModel("qwen3-30b-a3b", 2048, 768, 128, 8, 151936, 32, 4, 128, 48, "Qwen/Qwen3-30B-A3B config.json"),
        RealModel("olmoe-1b-7b", 2048, 1024, 64, 8, 50304, 16, 16, 128, 16, "allenai/OLMoE-1B-7B-0924 config.json"),
        # GPT's MLP (two matrices of 4 x 1,920) as one expert of three matrices with its FLOPs (3 x 5,120 = 2 x 7,680)
        RealModel("gpt-2.5b", 1920, 5120, 1, 1, 50257, 24, 24, 80, 52,
                  "Optimus-CC's GPT-2.5B (its artifact's Megatron-LM scripts)", bench_hidden=256),
    )
}


@dataclass(frozen=True)
class ClusterSpec:
    """The GPU cluster a figure is projected to: per-device peak and the share of the
    node's inter-node link each device gets, with the expert-parallel group spread over
    `nodes` nodes (a row crosses nodes with probability (nodes - 1) / nodes)."""

    name: str = "8 x H100 per node, 400 Gb/s per node, bf16 at 40% of 989 TFLOP/s, ep over 2 nodes"
    peak_flops: float = 989e12
    utilisation: float = 0.4
    node_link_bits: float = 400e9
    devices_per_node: int = 8
    nodes: int = 2
    element_bytes: int = 2  # bf16 rows

    def link_bytes_per_device(self) -> float:
        return self.node_link_bits / 8 / self.devices_per_node

    def remote_fraction(self) -> float:
        return (self.nodes - 1) / self.nodes


H100_CLUSTER = ClusterSpec()


def compute_over_comm(model: RealModel, cluster: ClusterSpec = H100_CLUSTER) -> float:
    """One MoE layer's compute time ÷ its inter-node all-to-all time, per token."""
    compute = model.flops_per_token_layer() / (cluster.peak_flops * cluster.utilisation)
    comm = model.a2a_bytes_per_token_layer(cluster.element_bytes) * cluster.remote_fraction() / cluster.link_bytes_per_device()
    return compute / comm


@dataclass(frozen=True)
class PipelineSpec(ClusterSpec):
    """The real pipelined run a dense figure is projected to: `stages` pipeline stages, each
    on one node whose `devices_per_node` GPUs split it by tensor parallelism and share the
    node's link, which the stage's activations (bf16) cross to the next stage's node."""

    name: str = "Optimus-CC's run: tp 8 x pp 4 on 8 x A100 nodes, 200 Gb/s per node, bf16 at 40% of 312 TFLOP/s"
    peak_flops: float = 312e12
    node_link_bits: float = 200e9
    stages: int = 4


A100_PIPELINE = PipelineSpec()


def pipeline_compute_over_comm(model: RealModel, spec: PipelineSpec = A100_PIPELINE) -> float:
    """One stage's forward and backward compute for a token ÷ the time its activation takes to
    cross the stage boundary (the gradient crosses back the other way at the same time)."""
    compute = model.layers / spec.stages * model.flops_per_token_layer() / (spec.devices_per_node * spec.peak_flops * spec.utilisation)
    comm = model.hidden * spec.element_bytes / (spec.node_link_bits / 8)
    return compute / comm


def aligned(width: float, multiple: int = 4) -> int:
    """A scaled width rounded to a multiple of 4 elements, as real configs align theirs (and as
    torch's grouped matmul on the CPU needs: rows of 16-byte multiples in float32)."""
    return max(multiple, multiple * round(width / multiple))


def scaled(model: RealModel, hidden: int | None = None, heads: int = 4, layers: int = 2) -> RealModel:
    """The model narrowed to `hidden` (default: its `bench_hidden`; heads of hidden // heads,
    as many k/v heads as q) and `layers` deep, keeping experts, top-k and the expert and
    vocabulary ratios to width."""
    hidden = hidden or model.bench_hidden
    return RealModel(
        f"{model.name} scaled", hidden, aligned(hidden * model.expert_hidden / model.hidden), model.experts,
        model.top_k, max(2, round(hidden * model.vocab / model.hidden)), heads, heads, hidden // heads, layers,
        f"{model.source}, scaled to hidden {hidden}", hidden,
    )


def bench_model(name: str, pp: int = 1) -> RealModel:
    """The real model named by --proportions, checked against the bench's pipeline setting."""
    if name not in REAL_MODELS:
        raise ValueError(f"--proportions {name!r}: no such model; known: {', '.join(REAL_MODELS)}")
    real = REAL_MODELS[name]
    if real.dense and pp < 2:
        raise ValueError(f"--proportions {name} is a dense model matched on its pipeline boundary: add --pp 2 "
                         "(and pipeline_split in --passes)")
    return real


def gpt_moe_kwargs(model: RealModel) -> dict[str, int]:
    """The built-in gpt-moe's arguments for a (scaled) model."""
    return {"hidden_size": model.hidden, "num_heads": model.heads, "num_layers": model.layers, "num_experts": model.experts,
            "top_k": model.top_k, "expert_hidden": model.expert_hidden, "vocab_size": model.vocab}


@dataclass(frozen=True)
class MatchedLink:
    """The emulated link rate that gives the scaled model the real one's compute ÷ comm."""

    real: RealModel
    model: RealModel
    ratio: float  # compute ÷ inter-node all-to-all time of the real model on the cluster
    rate_bits: float  # the emulated inter-node rate, bits/s
    flops_per_rank: float
    nodes: int

    def lines(self) -> list[str]:
        if self.real.dense:
            return self._pipeline_lines()
        cluster = H100_CLUSTER
        return [
            f"{self.real.name} ({self.real.source}): hidden {self.real.hidden}, expert hidden {self.real.expert_hidden}, "
            f"{self.real.experts} experts, top-{self.real.top_k}, vocabulary {self.real.vocab}",
            f"on {cluster.name}: compute / inter-node all-to-all per MoE layer = {self.ratio:.3g}",
            f"bench model: gpt-moe hidden {self.model.hidden}, expert hidden {self.model.expert_hidden}, {self.model.experts} "
            f"experts, top-{self.model.top_k}, vocabulary {self.model.vocab}, {self.model.layers} layers",
            f"emulated link for the same ratio at {self.flops_per_rank:.3g} FLOP/s per rank, {self.nodes} nodes, float32 rows: "
            f"{self.rate_bits / 1e6:.1f} Mbit/s",
        ]

    def _pipeline_lines(self) -> list[str]:
        return [
            f"{self.real.name} ({self.real.source}): hidden {self.real.hidden}, MLP FLOPs of 3 x {self.real.expert_hidden}, "
            f"{self.real.layers} layers, vocabulary {self.real.vocab}",
            f"on {A100_PIPELINE.name}: one stage's compute / its boundary send per token = {self.ratio:.3g}",
            f"bench model: dense gpt-moe (one expert) hidden {self.model.hidden}, expert hidden {self.model.expert_hidden}, "
            f"vocabulary {self.model.vocab}, {self.model.layers} layers in {self.nodes} stages",
            f"emulated link for the same ratio at {self.flops_per_rank:.3g} FLOP/s per rank, float32 activations: "
            f"{self.rate_bits / 1e6:.1f} Mbit/s",
        ]


def matched_link(name: str, *, flops_per_rank: float, nodes: int, hidden: int | None = None,
                 cluster: ClusterSpec = H100_CLUSTER, pp: int = 1) -> MatchedLink:
    """The scaled model for `name` and the emulated rate that keeps its compute ÷ comm (for a
    dense model, `pp` stages of two layers on `pp` nodes, matched on the stage boundary)."""
    real = bench_model(name, pp)
    if nodes < 2:
        raise ValueError("--proportions with --inter-node auto needs at least 2 nodes (the link it sizes joins them)")
    if real.dense:
        if nodes != pp:
            raise ValueError(f"--proportions {name} matches one pipeline stage a node: give --nodes {pp} --ranks-per-node 1 for --pp {pp}")
        model = scaled(real, hidden, layers=2 * pp)
        ratio = pipeline_compute_over_comm(real)
        compute_s = 2 * model.flops_per_token_layer() / flops_per_rank  # one stage, two layers
        return MatchedLink(real, model, ratio, 8 * model.hidden * 4 * ratio / compute_s, flops_per_rank, nodes)
    model = scaled(real, hidden)
    ratio = compute_over_comm(real, cluster)
    compute_s = model.flops_per_token_layer() / flops_per_rank
    remote_bytes = model.a2a_bytes_per_token_layer(4) * (nodes - 1) / nodes
    return MatchedLink(real, model, ratio, 8 * remote_bytes * ratio / compute_s, flops_per_rank, nodes)
