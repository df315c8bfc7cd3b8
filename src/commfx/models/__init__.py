"""Model specs: built-in names, `hf:<model_type>`, `path/to/file.py:function`, or the directory
of a saved transformers model (`save_pretrained`'s, or `commfx run --export DIR`'s).

Every spec resolves to `(model, example_inputs)` where the example inputs are the GLOBAL
batch; the runtime splits it along dim 0 across data-parallel ranks.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

from .gpt_moe import GPTMoE, GPTMoEConfig, build_gpt_moe
from .lm_loss import NextTokenLoss, shifted

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
    if (Path(spec) / "config.json").is_file():
        from .hf import build_hf_pretrained

        return build_hf_pretrained(spec, seed=seed, dtype=dtype, **kwargs)
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        if kwargs:
            given = ", ".join(f"--{k} {v}" for k, v in kwargs.items())
            raise ValueError(
                f"{given} does not apply to a model file: {spec} returns its own batch; change the batch there"
            )
        return _load_from_file(spec, seed=seed, dtype=dtype)
    raise ValueError(
        f"unknown model {spec!r}: use a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "'hf:<model_type>' (for example hf:mixtral), 'path/to/file.py:function' "
        "where the function returns (model, example_inputs), or a saved transformers model's directory (with config.json)"
    )


def _load_from_file(spec: str, *, seed: int, dtype: torch.dtype) -> ModelAndInputs:
    path_text, function_name = spec.rsplit(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"model file {path} does not exist (from model spec {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"commfx_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dynamo resolves a traced function's globals through its module's name
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ValueError(f"{path}:{error.lineno}: syntax error: {error.msg}") from None
    except Exception as error:
        raise ValueError(f"importing {path} raised {type(error).__name__}: {error}{_user_line(error, path)}") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        found = [name for name, value in vars(module).items() if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == module.__name__]
        raise ValueError(f"{path} has no function {function_name!r} (from model spec {spec!r}); it defines: {', '.join(found) or 'none'}")
    torch.manual_seed(seed)
    try:
        result = factory()
    except Exception as error:
        raise ValueError(f"{spec} raised {type(error).__name__}: {error}{_user_line(error, path)}") from None
    model, example_inputs = _model_and_inputs(spec, result)
    model = model.to(dtype)
    if isinstance(example_inputs, dict):
        return model, {k: _cast(t, dtype) for k, t in example_inputs.items()}
    return model, tuple(_cast(t, dtype) for t in example_inputs)


def _model_and_inputs(spec: str, result) -> tuple[torch.nn.Module, tuple | dict]:
    """Check what a model file's function returned: (model, inputs), inputs a tensor, a
    tuple of tensors, or a dict of keyword tensors."""
    kinds = f"({', '.join(type(r).__name__ for r in result)})" if isinstance(result, tuple) else type(result).__name__
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], torch.nn.Module) and not isinstance(result[0], torch.nn.Module):
        raise ValueError(f"{spec} returned {kinds}: the order is (model, example_inputs); swap them")
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ValueError(f"{spec}: the function must return (model, example_inputs), got {kinds}")
    model, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    if not all(isinstance(t, torch.Tensor) for t in values) or not values:
        raise ValueError(
            f"{spec}: example_inputs must be a tensor, a tuple of tensors or a dict of keyword tensors (the global batch); "
            f"got {type(inputs).__name__} of {sorted({type(v).__name__ for v in values})}"
        )
    return model, dict(inputs) if isinstance(inputs, dict) else tuple(inputs)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _user_line(error: BaseException, path: Path) -> str:
    """' (at file.py:12)': the deepest frame of the traceback inside the user's file."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f" (at {path}:{frames[-1].lineno})" if frames else ""


__all__ = ["BUILTIN_MODELS", "GPTMoE", "GPTMoEConfig", "NextTokenLoss", "build_gpt_moe", "load_model", "shifted"]
