"""Where a rank computes, and which torch.distributed backends carry its tensors.

A CPU run joins a gloo world. A CUDA run joins a world with two backends,
"cpu:gloo,cuda:nccl": CUDA tensors (every graph collective) go over NCCL, CPU tensors
(object messages: token counts, digests, checkpoint plans) over gloo, in the same process
groups. Each rank drives one GPU, its local rank on its node (NCCL refuses two ranks on one
GPU), so a launch is checked against the GPUs the node has before any rank starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher imports this module; torch loads in the ranks, not before
    import torch

DEVICES = ("cpu", "cuda")
CUDA_BACKENDS = "cpu:gloo,cuda:nccl"


class DeviceError(ValueError):
    """A device the run cannot use, said before any rank starts."""


def check_device(device: str, ranks_per_node: int) -> None:
    """Refuse a device this machine cannot give every local rank (one GPU each)."""
    if device not in DEVICES:
        raise DeviceError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("--device cuda needs a CUDA GPU and a CUDA build of torch; this machine has neither (use --device cpu)")
    found = torch.cuda.device_count()
    if ranks_per_node > found:
        raise DeviceError(
            f"--device cuda runs one rank per GPU (NCCL refuses two ranks on one GPU), and {ranks_per_node} ranks "
            f"would share this node's {found} GPU(s); lower --world-size to {found} or run on more nodes"
        )


def process_group_backend(device: str) -> str:
    """The backend string of `init_process_group` for a run on `device`."""
    return CUDA_BACKENDS if device == "cuda" else "gloo"


def bind_rank(device: str, local_rank: int) -> "torch.device":
    """Make `local_rank`'s GPU this process's current device (CUDA), and return the device."""
    import torch

    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def module_device_type(module: "torch.nn.Module") -> str:
    """"cuda" when the module's parameters live on a GPU, else "cpu" (a module with none: cpu)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device.type
    return "cpu"


def world_device_type() -> str:
    """"cuda" when the default process group carries CUDA tensors over NCCL, else "cpu"."""
    import torch.distributed as dist

    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
