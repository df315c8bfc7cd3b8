"""Model specs: built-in names, `hf:<model_type>`, or `path/to/file.py:function`.

Every spec resolves to `(model, example_inputs)` where the example inputs are the GLOBAL
batch; the runtime splits it along dim 0 across data-parallel ranks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import torch

from .gpt_moe import GPTMoE, GPTMoEConfig, build_gpt_moe

ModelAndInputs = tuple[torch.nn.Module, tuple[torch.Tensor, ...]]

BUILTIN_MODELS: dict[str, Callable[..., ModelAndInputs]] = {
    "gpt-moe": build_gpt_moe,
    "gpt-moe-tiny": lambda **kw: build_gpt_moe(
        **{"num_layers": 1, "num_experts": 4, "hidden_size": 16, "expert_hidden": 12, "vocab_size": 32, **kw}
    ),
}


def load_model(spec: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> ModelAndInputs:
    """Resolve a model spec (see module docstring) to a model in `dtype` and its global batch."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec](seed=seed, dtype=dtype, **kwargs)
    if spec.startswith("hf:"):
        from .hf import build_hf_moe

        return build_hf_moe(spec[3:], seed=seed, dtype=dtype, **kwargs)
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        return _load_from_file(spec, seed=seed, dtype=dtype)
    raise ValueError(
        f"unknown model {spec!r}: use a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "'hf:<model_type>' (for example hf:mixtral), or 'path/to/file.py:function' "
        "where the function returns (model, example_inputs)"
    )


def _load_from_file(spec: str, *, seed: int, dtype: torch.dtype) -> ModelAndInputs:
    path_text, function_name = spec.rsplit(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"model file {path} does not exist (from model spec {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"commfx_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(f"{path} has no function {function_name!r} (from model spec {spec!r})")
    torch.manual_seed(seed)
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ValueError(f"{spec}: the function must return (model, example_inputs), got {type(result).__name__}")
    model, example_inputs = result
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    model = model.to(dtype)
    example_inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in example_inputs)
    return model, example_inputs


__all__ = ["BUILTIN_MODELS", "GPTMoE", "GPTMoEConfig", "build_gpt_moe", "load_model"]
