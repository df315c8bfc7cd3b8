"""The batch against the model's forward, checked before capture, and the model's own
exceptions told apart from graph breaks.

Without these a misnamed keyword, float token ids or a forward that raises all reach the
user from dynamo as a graph break with advice about control flow."""

from __future__ import annotations

import difflib
import inspect
import re
import traceback
import typing
from pathlib import Path

import torch

# Parameter names that hold token ids (indices into an embedding); not labels, which a
# regression head takes as floats.
_ID_NAMES = re.compile(r"(^|_)ids$|^idx$|^indices$|^tokens?$")
_COMMFX = str(Path(__file__).resolve().parents[1])


class InputError(ValueError):
    """The example inputs do not fit the model's forward."""


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def input_names(model: torch.nn.Module, inputs) -> list[str]:
    """The forward's parameter name of each tensor of a batch (a dict's keys; for a tuple, the
    positional parameters in order, else the position)."""
    if isinstance(inputs, dict):
        return list(inputs)
    signature = forward_signature(model)
    positional = [
        p.name for p in (signature.parameters.values() if signature else ())
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return [positional[i] if i < len(positional) else str(i) for i in range(len(inputs))]


def check_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Keyword names against the forward's parameters, then token ids against their dtype."""
    check_keywords(model, kwargs)
    names = [*input_names(model, args), *kwargs]
    for name, tensor in zip(names, (*args, *kwargs.values())):
        if tensor.is_floating_point() and _ID_NAMES.search(name) and _has_embedding(model):
            raise InputError(
                f"input {name} is {tensor.dtype} but holds token ids, which index an embedding: pass an integer "
                f"tensor (torch.long, e.g. {name}.long())"
            )


def check_keywords(model: torch.nn.Module, kwargs: dict) -> None:
    """Every keyword must name a parameter of forward. A `**kwargs` typed as Unpack[TypedDict]
    (transformers' TransformersKwargs) takes that dict's keys too; an untyped `**kwargs` takes
    any name but one a letter or two from a named parameter (`label` for `labels`), which is a
    typo: the model would never read it."""
    signature = forward_signature(model)
    if signature is None or not kwargs:
        return
    params = list(signature.parameters.values())
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_keyword = next((p for p in params if p.kind == p.VAR_KEYWORD), None)
    typed = _typed_keys(var_keyword) if var_keyword is not None else set()
    for key in kwargs:
        if key in named or key in typed:
            continue
        close = difflib.get_close_matches(key, named, n=1, cutoff=0.6 if typed is not None else 0.8)
        if var_keyword is not None and typed is None and not close:
            continue  # an untyped **kwargs the model may read by this name
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(
            f"input {key!r} is not a parameter of {type(model).__name__}.forward{hint}; it takes "
            f"{', '.join(named) or 'no named parameters'}. Fix the key in the example inputs."
        )


def _typed_keys(var_keyword: inspect.Parameter) -> set[str] | None:
    """The keys of `**kwargs: Unpack[SomeTypedDict]`; None when **kwargs is untyped."""
    annotation = var_keyword.annotation
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return None
    for arg in (*typing.get_args(annotation), annotation):
        if isinstance(arg, type) and hasattr(arg, "__required_keys__"):  # a TypedDict
            return set(arg.__required_keys__) | set(arg.__optional_keys__)
    return None


def _has_embedding(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Embedding) for m in model.modules())


def forward_exception(model: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Run forward eagerly: if it raises, 'ValueError: message (at file.py:12)' with the
    deepest frame outside torch and commfx; None when it runs (then dynamo's error stands)."""
    from ..models.hf import training_forward

    try:
        with torch.no_grad(), training_forward(model):
            model(*args, **kwargs)
    except Exception as error:
        frames = [
            f for f in traceback.extract_tb(error.__traceback__)
            if "/torch/" not in f.filename and "/site-packages/" not in f.filename and not f.filename.startswith(_COMMFX)
        ]
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        return f"{type(error).__name__}: {error}{where}"
    return None
