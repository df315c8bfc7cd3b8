"""The MoE blocks of a model as the DeepSpeed-MoE peer reads them: where each block's router and
stacked experts live, its top-k and whether it renormalises, and what DeepSpeed's gate cannot
express (refused by name). One recogniser per block kind, read top to bottom.

- **Top-k weights.** k = 2 (`top2gating`) and k >= 3 (`topkgating`) renormalise the kept
  weights to sum to one, as gpt-moe, Mixtral and Qwen3-MoE (`norm_topk_prob=True`) do. k = 1
  (`top1gating`) weights the expert by its raw softmax probability (Switch): the same as a
  router that does not renormalise, not as one that does. A router whose renormalisation does
  not match is refused (:class:`PeerUnsupported`).
- **Routing bias.** DeepSpeed's gate has no logit bias: gpt-moe's `logit_bias` buffer must be
  zero (adding zero is exact), otherwise the model is refused.

Which models: the built-in gpt-moe family (`commfx.models.gpt_moe.MoEBlock`), HF Mixtral
(`MixtralSparseMoeBlock`) and HF Qwen3-MoE (`Qwen3MoeSparseMoeBlock`). Any other module holding
stacked expert weights is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .common import PeerUnsupported

NAME = "deepspeed_moe"


@dataclass(frozen=True)
class MoESpec:
    """One MoE block of the model, read by a recogniser: where its weights are, and its routing."""

    path: str  # the block's module path in the model
    kind: str  # which recogniser matched ("gpt-moe", "mixtral", "qwen3_moe")
    router_weight: str  # model parameter names: [E, H], [E, 2I, H], [E, H, I]
    gate_up: str
    down: str
    num_experts: int
    top_k: int
    renormalize: bool  # the router rescales its top-k weights to sum to one
    act: nn.Module


def _hf_block(kind: str, renormalize: Callable[[nn.Module], bool], checks: Callable[[str, nn.Module], None]):
    def read(path: str, block: nn.Module) -> MoESpec:
        gate, experts = block.gate, block.experts
        checks(path, block)
        for attribute in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(experts, attribute, None) is not None or getattr(experts, "has_bias", False):
                raise PeerUnsupported(f"{path}.experts ({type(experts).__name__}) has biased experts; the peer's expert is bias-free")
        if getattr(experts, "is_transposed", False):
            raise PeerUnsupported(f"{path}.experts ({type(experts).__name__}) stores transposed expert weights")
        return MoESpec(path, kind, f"{path}.gate.weight", f"{path}.experts.gate_up_proj", f"{path}.experts.down_proj",
                       gate.weight.shape[0], int(gate.top_k), renormalize(block), experts.act_fn)

    return read


def _no_jitter(path: str, block: nn.Module) -> None:
    if getattr(block, "jitter_noise", 0) and block.jitter_noise > 0:
        raise PeerUnsupported(f"{path} ({type(block).__name__}) multiplies its input by random jitter (router_jitter_noise="
                              f"{block.jitter_noise}); the peer's gate runs without noise. Set router_jitter_noise=0")


def _read_gpt_moe(path: str, block: nn.Module) -> MoESpec:
    bias = block.router.logit_bias
    if bias.count_nonzero().item():
        raise PeerUnsupported(f"{path}.router has a nonzero logit_bias; DeepSpeed's TopKGate has no logit bias")
    return MoESpec(path, "gpt-moe", f"{path}.router.weight", f"{path}.experts.gate_up_proj", f"{path}.experts.down_proj",
                   block.experts.num_experts, block.router.top_k, True, nn.SiLU())


def _recognisers() -> list[tuple[Callable[[nn.Module], bool], Callable[[str, nn.Module], MoESpec]]]:
    """(matches, read) per block kind the peer can express: a table, read top to bottom."""
    from ...models.gpt_moe import MoEBlock

    return [
        (lambda m: isinstance(m, MoEBlock), _read_gpt_moe),
        (lambda m: type(m).__name__ == "MixtralSparseMoeBlock", _hf_block("mixtral", lambda b: True, _no_jitter)),
        (lambda m: type(m).__name__ == "Qwen3MoeSparseMoeBlock",
         _hf_block("qwen3_moe", lambda b: bool(b.gate.norm_topk_prob), lambda p, b: None)),
    ]


def find_moe_blocks(model: nn.Module) -> list[MoESpec]:
    """Every MoE block of `model`, or PeerUnsupported naming what the peer cannot express."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise PeerUnsupported(f"{type(model).__name__} has output_router_logits=True: it adds its own load-balancing loss "
                              "from the router logits, which DeepSpeed's gate does not give back. Set output_router_logits=False")
    recognisers, specs, inside = _recognisers(), [], []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        for matches, read in recognisers:
            if matches(module):
                specs.append(read(path, module))
                inside.append(path)
                break
    for name, parameter in model.named_parameters():
        if parameter.dim() == 3 and not any(name.startswith(p + ".") for p in inside):
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            raise PeerUnsupported(f"{name} ({type(owner).__name__}) holds stacked expert weights in a block the {NAME} peer "
                                  "does not know; it rebuilds gpt-moe, Mixtral and Qwen3-MoE blocks")
    if not specs:
        raise PeerUnsupported(f"{type(model).__name__} has no MoE block the {NAME} peer can rebuild")
    for spec in specs:
        _check_expressible(spec)
    return specs


def _check_expressible(spec: MoESpec) -> None:
    """DeepSpeed's TopKGate: k = 1 weights by the raw probability, k >= 2 renormalises."""
    where = f"{spec.path} ({spec.kind}, top_k={spec.top_k})"
    if not 1 <= spec.top_k <= spec.num_experts:
        raise PeerUnsupported(f"{where}: top_k must be between 1 and the {spec.num_experts} experts")
    if spec.top_k == 1 and spec.renormalize:
        raise PeerUnsupported(f"{where}: DeepSpeed's top-1 gate weights the expert by its softmax probability; this router "
                              "renormalises its top-1 weight to 1")
    if spec.top_k >= 2 and not spec.renormalize:
        raise PeerUnsupported(f"{where}: DeepSpeed's top-{spec.top_k} gate renormalises the kept weights to sum to one; "
                              "this router does not (norm_topk_prob=False)")
