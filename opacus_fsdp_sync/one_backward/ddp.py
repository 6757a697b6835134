"""DDP hand-off: clipped gradients averaged over ranks in one bucketed all-reduce, as DDP does.

DDP's reducer divides each parameter's gradient by the world size while copying it into a flat
bucket, sums the buckets over ranks and copies them back into ``p.grad``. Here the clipped
gradients are first added to ``p.grad`` (as autograd would accumulate them), then every gradient
DDP would reduce goes through the same arithmetic: one ``all_reduce`` per bucket, all launched
before any is waited on. DDP itself sees no parameter gradient in the step (see
:mod:`opacus_fsdp_sync.distributed._ddp_internals`), so nothing is reduced twice.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import _ddp_internals as internals
from .step import by_parameter

logger = logging.getLogger(__name__)


def _add_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:  # in place: keeps DDP's gradient_as_bucket_view aliasing
        p.grad.add_(g)


def buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets of one device and dtype, as DDP fills them.

    Tensors are taken in reverse order (DDP's approximation of the order gradients become
    ready); a bucket is closed once it holds at least ``cap_bytes``.
    """
    open_: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    out: list[list[int]] = []
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        key = (t.device, t.dtype)
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        if sizes[key] >= cap_bytes:
            out.append(open_.pop(key))
            sizes.pop(key)
    out.extend(open_.values())
    return out


def all_reduce_mean(tensors: list[torch.Tensor], group, cap_bytes: int) -> int:
    """Averages ``tensors`` in place over ``group``, in flat buckets of about ``cap_bytes``.

    Each tensor is divided by the group size before the sum, as DDP's reducer does.

    Returns:
        The number of all-reduces issued.
    """
    world = dist.get_world_size(group)
    pending = []
    for idx in buckets(tensors, cap_bytes):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        flat.mul_(1.0 / world)
        pending.append((idx, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for idx, flat, work in pending:
        work.wait()
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
            offset += n
    return len(pending)


class DDPHandoff:
    """Delivers one step's clipped gradients to a DDP model's ``p.grad``, averaged over ranks.

    Args:
        ddp: The ``DistributedDataParallel`` module (its reducer is left alone).

    Raises:
        DDPInternalsError: if DDP's attributes are not as on the verified torch releases.
    """

    phase = "all_reduce"
    """The name of the hand-off phase in timings and collective counts."""

    def __init__(self, ddp: nn.Module):
        self.ddp = ddp
        self.params = internals.reduced_parameters(ddp)
        self.group = internals.process_group(ddp)
        self.cap_bytes = internals.bucket_bytes_cap(ddp)

    def __call__(self, grads: dict) -> None:
        """Adds the clipped gradients to ``p.grad`` and averages every reduced gradient.

        A parameter DDP reduces that got no gradient on this rank contributes zeros (and
        receives the average), as with DDP's ``find_unused_parameters=True``; a parameter DDP
        ignores keeps its local gradient.
        """
        for p, g in by_parameter(grads).values():
            _add_grad(p, g)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_mean([p.grad for p in self.params], self.group, self.cap_bytes)
