"""Snapshots of synced gradients' local shards, and combining them with later gradients.

A snapshot copies each rank's local shard (see :mod:`.ops`), so saving, weighting, loading and
same-sign filtering issue no collective; a snapshot fits only the model and sharding it was
taken on, which every operation checks by name, API and shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .microbatch import GradLayout, resolve
from .ops import local_shard, select, sharded_api


@dataclass(kw_only=True)
class GradSnapshot:
    """Copies of gradients' local shards, to combine with later gradients.

    Snapshots are elementwise on local shards, so two snapshots of the same model (same API and
    sharding) combine without communication.

    Attributes:
        grads: Local gradient shards by parameter name.
        api: The API the snapshot was taken under (its shards fit only that layout).
    """

    grads: dict[str, torch.Tensor]
    api: str | None


def save_grads(model: nn.Module, prefixes: str | Iterable[str] | None = None) -> GradSnapshot:
    """Copies the current gradients' local shards (no collective).

    Args:
        model: See :func:`~opacus_fsdp_sync.grad_access.microbatch.resolve`.
        prefixes: Only parameters under these module prefixes; None: all.

    Raises:
        ValueError: for an unknown prefix (see :func:`select`).
    """
    layout = resolve(model)
    names = set(layout.params)
    if prefixes is not None:
        names = {n for members in select(layout.params, prefixes).values() for n in members}
    grads = {
        n: local_shard(p.grad).detach().clone()
        for n, p in layout.params.items()
        if n in names and p.grad is not None
    }
    return GradSnapshot(grads=grads, api=layout.api)


def _target(layout: GradLayout, snapshot: GradSnapshot) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Pairs each snapshot entry with its parameter, after checking name, API and shape."""
    full_both = not (sharded_api(layout.api) or sharded_api(snapshot.api))  # DDP and one device
    if layout.api != snapshot.api and not full_both:
        raise ValueError(
            f"The snapshot was taken under {snapshot.api or 'one device'}, the model runs under "
            f"{layout.api or 'one device'}: local shards differ; take a new snapshot."
        )
    pairs = []
    for name, value in snapshot.grads.items():
        param = layout.params.get(name)
        if param is None:
            raise ValueError(
                f"The snapshot has a gradient for {name!r}, which is not a parameter of this "
                "model: take snapshots and apply them on the same model."
            )
        shape = (
            local_shard(param.grad).shape if param.grad is not None else local_shard(param).shape
        )
        if value.shape != shape:
            raise ValueError(
                f"Snapshot gradient {name!r} has local shape {tuple(value.shape)} but the "
                f"parameter's local gradient shard is {tuple(shape)}: the sharding changed since "
                "the snapshot; take a new one."
            )
        pairs.append((param, value))
    return pairs


def _set_grad(param: nn.Parameter, local: torch.Tensor) -> None:
    """Gives a parameter that has no gradient one whose local shard is ``local``."""
    if isinstance(param, DTensor):
        param.grad = DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    else:
        param.grad = local


def add_grads(
    model: nn.Module, snapshot: GradSnapshot, *, weight: float = 1.0, current_weight: float = 1.0
) -> int:
    """``grad = current_weight * grad + weight * snapshot`` on every parameter in the snapshot.

    A parameter without a gradient gets ``weight * snapshot``. Other parameters are unchanged.

    Args:
        model: See :func:`~opacus_fsdp_sync.grad_access.microbatch.resolve`.
        snapshot: From :func:`save_grads` (or :func:`same_sign_filter`) on the same model.
        weight: Factor of the snapshot.
        current_weight: Factor of the current gradients.

    Returns:
        The number of gradients changed on this rank.

    Raises:
        ValueError: for a non-finite weight, or a snapshot that does not fit the model.
    """
    for label, value in (("weight", weight), ("current_weight", current_weight)):
        if not math.isfinite(value):
            raise ValueError(f"{label}={value}: must be a finite number")
    layout = resolve(model)
    pairs = _target(layout, snapshot)
    for param, value in pairs:
        if param.grad is None:
            _set_grad(param, value.mul(weight).to(param.dtype))
            continue
        local = local_shard(param.grad)
        if current_weight != 1.0:
            local.mul_(current_weight)
        local.add_(value.to(local.dtype), alpha=weight)
    return len(pairs)


def load_grads(model: nn.Module, snapshot: GradSnapshot) -> int:
    """Overwrites the gradients of the parameters in the snapshot with its values.

    Returns:
        The number of gradients written on this rank.

    Raises:
        ValueError: for a snapshot that does not fit the model.
    """
    layout = resolve(model)
    pairs = _target(layout, snapshot)
    for param, value in pairs:
        if param.grad is None:
            _set_grad(param, value.clone().to(param.dtype))
        else:
            local_shard(param.grad).copy_(value)
    return len(pairs)


def same_sign_filter(first: GradSnapshot, second: GradSnapshot) -> GradSnapshot:
    """``first`` where its sign agrees with ``second``'s, zero elsewhere (new snapshot).

    Args:
        first: The gradients to filter.
        second: The reference; both must come from the same model and layout.

    Raises:
        ValueError: when the snapshots hold different parameters, shapes or layouts.
    """
    if first.api != second.api:
        raise ValueError(
            f"Snapshots from different layouts ({first.api} and {second.api}) cannot be "
            "compared elementwise; take both on the same model."
        )
    if first.grads.keys() != second.grads.keys():
        missing = sorted(first.grads.keys() ^ second.grads.keys())
        raise ValueError(
            f"The snapshots cover different parameters ({', '.join(missing[:5])}...); save "
            "both with the same prefixes after backward passes reaching the same parameters."
        )
    out = {}
    for name, a in first.grads.items():
        b = second.grads[name]
        if a.shape != b.shape:
            raise ValueError(
                f"Snapshot shapes differ for {name!r}: {tuple(a.shape)} vs {tuple(b.shape)}."
            )
        out[name] = torch.where(torch.sign(a) == torch.sign(b), a, torch.zeros_like(a))
    return GradSnapshot(grads=out, api=first.api)
