"""Canonical communication ops. They hand their work to the runtime comm scheduler.

A group is named (`"ep"`, `"world"`, ...), never a rank list or a process-group object,
so the graph is the same on every rank: the runtime resolves the name to this rank's
group when the op runs. Split sizes travel as count tensors (rank-dependent values are
runtime inputs, never literals); their row sums are the per-rank splits.
"""

from __future__ import annotations

import torch

from ..runtime.comm import current_scheduler


@torch.library.custom_op("commfx::all_to_all", mutates_args=())
def all_to_all(
    x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, group: str, priority: str = "a2a", tag: str = ""
) -> torch.Tensor:
    """Uneven all-to-all of rows: rank r sends send_counts[r].sum() rows to rank r of `group`.

    send_counts/recv_counts are [P, ...] int64 (P = group size); rows are grouped by
    destination in rank order. `priority` is the scheduler's class (see
    runtime/priority.py); `tag` names the collective in traces (e.g. "dispatch 2/4").
    """
    scheduler = current_scheduler()
    if _alone(scheduler, group, priority):
        return x.clone(memory_format=torch.contiguous_format)
    send, recv = _splits(send_counts, recv_counts)
    return scheduler.all_to_all(x, send, recv, group, priority, tag)


def _alone(scheduler, group: str, priority: str) -> bool:
    """A group of one rank: its all-to-all is the identity, run with no collective and no
    host sync (the counts are never read); graphs still show it, the runtime skips it."""
    return scheduler.group(group, priority).size == 1


def _splits(send_counts: torch.Tensor, recv_counts: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows per rank to send and to receive, read with one device-to-host copy (one sync)."""
    send = send_counts.reshape(send_counts.shape[0], -1).sum(1)
    recv = recv_counts.reshape(recv_counts.shape[0], -1).sum(1)
    if send.device != recv.device:
        return send.tolist(), recv.tolist()
    both = torch.cat([send, recv.to(send.dtype)]).tolist()
    return both[: send.numel()], both[send.numel() :]


@all_to_all.register_fake
def _(x, send_counts, recv_counts, group, priority="a2a", tag=""):
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:]))


def all_to_all_setup(ctx, inputs, output):
    _, send_counts, recv_counts, group, priority, tag = inputs
    ctx.save_for_backward(send_counts, recv_counts)
    ctx.group, ctx.priority, ctx.tag = group, priority, tag


def _all_to_all_backward(ctx, grad):
    send_counts, recv_counts = ctx.saved_tensors
    # The adjoint of a permutation across ranks is the reverse exchange.
    tag = f"{ctx.tag} (bw)" if ctx.tag else ""
    return all_to_all(grad.contiguous(), recv_counts, send_counts, ctx.group, ctx.priority, tag), None, None, None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=all_to_all_setup)


@torch.library.custom_op("commfx::exchange_counts", mutates_args=())
def exchange_counts(counts: torch.Tensor, group: str, group_size: int, priority: str = "a2a") -> torch.Tensor:
    """counts [E] (rows for every expert) -> [P, E/P]: what each rank of `group` sends my experts.
    `priority`: the lane (microbatch_overlap puts counts ahead of the other micro-batch's rows)."""
    send = counts.reshape(group_size, -1).contiguous()
    scheduler = current_scheduler()
    if _alone(scheduler, group, priority):
        return send.clone()
    ones = [1] * group_size
    received = scheduler.all_to_all(send, ones, ones, group, priority)
    return received.reshape(group_size, -1)


@exchange_counts.register_fake
def _(counts, group, group_size, priority="a2a"):
    return counts.new_empty((group_size, counts.shape[0] // group_size))


@torch.library.custom_op("commfx::local_shard", mutates_args=())
def local_shard(full: torch.Tensor, group: str, parts: int) -> torch.Tensor:
    """This rank's block of dim 0 of `full` (block = its rank in `group`), resolved at run time.

    Used where the user owns full-size parameters (the torch.compile backend): the graph
    stays rank-independent and gradients flow back into the full tensor's rows.
    """
    size = full.shape[0] // parts
    return full.narrow(0, current_scheduler().group(group).rank * size, size).clone()


@local_shard.register_fake
def _(full, group, parts):
    return full.new_empty((full.shape[0] // parts, *full.shape[1:]))


@torch.library.custom_op("commfx::local_shard_backward", mutates_args=())
def local_shard_backward(grad: torch.Tensor, full_rows: int, group: str) -> torch.Tensor:
    """Scatter a shard's gradient into zeros shaped like the full tensor."""
    out = grad.new_zeros((full_rows, *grad.shape[1:]))
    start = current_scheduler().group(group).rank * grad.shape[0]
    out[start : start + grad.shape[0]] = grad
    return out


@local_shard_backward.register_fake
def _(grad, full_rows, group):
    return grad.new_empty((full_rows, *grad.shape[1:]))


def _local_shard_setup(ctx, inputs, output):
    ctx.full_rows, ctx.group = inputs[0].shape[0], inputs[1]


local_shard.register_autograd(
    lambda ctx, grad: (local_shard_backward(grad, ctx.full_rows, ctx.group), None, None), setup_context=_local_shard_setup
)


# Split-phase all-to-all, as in torch's functional collectives: `all_to_all_start` queues
# the exchange and returns its output buffer, `wait_tensor` returns the same buffer once it
# is filled. They exist only in lowered (post-autograd) graphs, made by
# `commfx.passes.schedule.overlap.overlap_collectives`, so they need no autograd or fake implementation.
_lib = torch.library.Library("commfx", "FRAGMENT")
_lib.define(
    "all_to_all_start(Tensor x, Tensor send_counts, Tensor recv_counts, str group, str priority, str tag) -> Tensor"
)
_lib.define("wait_tensor(Tensor(a) t) -> Tensor(a)")


def _all_to_all_start(x, send_counts, recv_counts, group, priority, tag):
    scheduler = current_scheduler()
    if _alone(scheduler, group, priority):
        return x.clone(memory_format=torch.contiguous_format)
    send, recv = _splits(send_counts, recv_counts)
    return scheduler.start_all_to_all(x, send, recv, group, priority, tag)


def _wait_tensor(t):
    return current_scheduler().wait_tensor(t)


_lib.impl("all_to_all_start", _all_to_all_start, "CompositeExplicitAutograd")
_lib.impl("wait_tensor", _wait_tensor, "CompositeExplicitAutograd")
