"""Autocast rules for commfx's compute ops, so `torch.autocast` reaches them as it reaches a linear.

A custom op is below autocast by default: under `torch.autocast` (the torch.compile door) it
would receive the float32 activations and masters and compute in float32. Each op registered
here casts the operands it multiplies (float32/float16/bfloat16 tensors on the autocast's
device, never float64) to the autocast's dtype, then runs with autocast off, as aten's
lower-precision ops do; the casts are recorded by autograd, so the masters' gradients come
back in float32. `torch.library.register_autocast` casts to one dtype fixed at registration;
these rules follow the region's dtype (bf16 or fp16) and cast only the operands named.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("commfx", "FRAGMENT")
DEVICE_TYPES = ("cpu", "cuda")

# op name -> positions of the arguments cast to the autocast dtype (what `register_autocast` was given)
AUTOCAST_ARGS: dict[str, tuple[int, ...]] = {}


def register_autocast(op: torch._ops.OpOverload, cast: tuple[int, ...]) -> None:
    """Under autocast on cpu or cuda, cast `op`'s arguments at positions `cast` to the autocast dtype."""
    name = op._schema.name.split("::", 1)[1]
    AUTOCAST_ARGS[name] = tuple(cast)
    for device_type in DEVICE_TYPES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        _LIB.impl(name, _kernel(op, cast, device_type, getattr(torch._C.DispatchKey, key)), key, with_keyset=True)


def _kernel(op, cast, device_type, dispatch_key):
    def kernel(_keyset, *args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        args = tuple(_cast(a, device_type, dtype) if i in cast else a for i, a in enumerate(args))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(dispatch_key)):
            return op(*args, **kwargs)

    return kernel


def _cast(value, device_type: str, dtype: torch.dtype):
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
        and value.dtype != dtype
    ):
        return value.to(dtype)
    return value
