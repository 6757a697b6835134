"""Per-layer operations on synced gradients: views, norms, freezing, snapshots, combining.

Everything works on each rank's local shard (``DTensor.to_local()`` under FSDP2, the flat slice
FSDP1 exposes as ``param.grad`` with ``use_orig_params=True``, the full gradient under DDP or on
one device), so it is sharding-aware and issues no collective, except :func:`full_grads` (one
all-gather per parameter) and :func:`layer_grad_norms` (one all-reduce for all layers together).
Layers are named by module prefixes of the user's own parameter names (``"model.layers.3"``).
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..apis.api import FSDP1, FSDP2, TP
from ..apis.registry import record_for
from .microbatch import GradLayout, resolve

logger = logging.getLogger(__name__)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (an alias, no copy), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def select(names: Iterable[str], prefixes: str | Iterable[str]) -> dict[str, list[str]]:
    """The parameter names under each module prefix.

    Args:
        names: Parameter names.
        prefixes: Module prefixes (a single string is one prefix; ``""`` is the whole model).

    Returns:
        ``{prefix: [names under it]}`` in the order given.

    Raises:
        ValueError: for no prefix at all, or for a prefix no parameter is under (with the
            closest valid prefixes).
    """
    names = list(names)
    prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    if not prefixes:
        raise ValueError("No layer prefix given: pass module prefixes such as 'model.layers.0'.")
    out: dict[str, list[str]] = {}
    for prefix in prefixes:
        if prefix == "":
            out[prefix] = names
            continue
        matched = [n for n in names if _under(n, prefix)]
        if not matched:
            modules = sorted({n[:i] for n in names for i, c in enumerate(n) if c == "."})
            close = difflib.get_close_matches(prefix, modules, n=3) or modules[:5]
            raise ValueError(
                f"Unknown layer prefix {prefix!r}: no parameter name is {prefix!r} or starts with "
                f"'{prefix}.'. Use names as model.named_parameters() gives them without wrapper "
                f"prefixes, e.g. {', '.join(repr(c) for c in close)}."
            )
        out[prefix] = matched
    return out


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient on this rank, as a local shard (aliases, no copy, no collective).

    FSDP2: ``param.grad.to_local()``; FSDP1: ``param.grad`` (this rank's flat slice; ranks
    whose slice of a parameter is empty have none); DDP and one device: ``param.grad``. Writing
    into these tensors changes the gradients the optimizer will use.

    Args:
        model: See :func:`~opacus_fsdp_sync.grad_access.microbatch.resolve`.
    """
    layout = resolve(model)
    return {n: _local(p.grad) for n, p in layout.params.items() if p.grad is not None}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's full (synced) gradient, gathered: a collective every rank must call.

    FSDP2: ``param.grad.full_tensor()``; FSDP1: copies taken under
    ``summon_full_params(with_grads=True)``; DDP and one device: ``param.grad`` (no copy).

    Args:
        model: See :func:`~opacus_fsdp_sync.grad_access.microbatch.resolve`.
    """
    layout = resolve(model)
    return _FULL.get(layout.api, _full_from_grads)(layout)


def _full_from_grads(layout: GradLayout) -> dict[str, torch.Tensor]:
    """FSDP2: ``full_tensor()`` of each DTensor gradient; DDP and one device: ``param.grad``."""
    return {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in layout.params.items()
        if p.grad is not None
    }


def _fsdp1_full(layout: GradLayout) -> dict[str, torch.Tensor]:
    """FSDP1: copies taken under ``summon_full_params(with_grads=True)``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: dict[str, torch.Tensor] = {}
    for root in layout.roots:
        with FSDP.summon_full_params(root, writeback=False, with_grads=True):
            for name, param in layout.params.items():
                if param.grad is not None and name not in out:
                    out[name] = param.grad.detach().clone()
    return out


#: How each API gathers full gradients (others: :func:`_full_from_grads`).
_FULL = {FSDP1: _fsdp1_full}


def _replication(layout: GradLayout) -> dict[str, int]:
    """How many ranks hold each parameter's local gradient shard (1 when fully sharded).

    Parameters FSDP does not manage count as replicated on every rank.
    """
    if not layout.record.capabilities.sharded:  # full gradients, not all-reduced
        return dict.fromkeys(layout.params, 1)
    return _REPLICATION[layout.api](layout)


def _fsdp1_replication(layout: GradLayout) -> dict[str, int]:
    """FSDP1: every rank for a NO_SHARD unit, the rank count over the unit's group otherwise."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    world = dist.get_world_size() if dist.is_initialized() else 1
    owner: dict[int, nn.Module] = {}
    for state in FSDP.fsdp_modules(layout.model):  # pre-order: inner instances win
        for param in state.parameters():
            owner[id(param)] = state
    out = {}
    for name, param in layout.params.items():
        state = owner.get(id(param))
        if state is None or state.sharding_strategy == ShardingStrategy.NO_SHARD:
            out[name] = world
        else:
            out[name] = world // state.process_group.size()
    return out


def _fsdp2_replication(layout: GradLayout) -> dict[str, int]:
    """FSDP2: the ranks over the DTensor's replicated mesh dimensions (HSDP replicas)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for name, param in layout.params.items():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            shards = math.prod(mesh.size(d) for d, p in enumerate(param.placements) if p.is_shard())
            out[name] = world // shards
        else:
            out[name] = world
    return out


#: How many ranks hold each local gradient shard, for the sharded APIs.
_REPLICATION = {FSDP1: _fsdp1_replication, FSDP2: _fsdp2_replication, TP: _fsdp2_replication}


def _sharded(api: str | None) -> bool:
    return record_for(api).capabilities.sharded


@dataclass(kw_only=True)
class GradNorms:
    """Global L2 gradient norms.

    Attributes:
        per_layer: Norm of the gradients under each requested prefix.
        total: Norm of all gradients of the model.
    """

    per_layer: dict[str, float]
    total: float


def layer_grad_norms(model: nn.Module, prefixes: str | Iterable[str] | None = None) -> GradNorms:
    """Per-layer and total L2 norms of the synced gradients, correct under any sharding.

    Each rank sums the squares of its local shards per layer; under FSDP1/FSDP2 one all-reduce
    of all layers' sums together makes them global (replicated shards, e.g. NO_SHARD or HSDP,
    are counted once). DDP and one device hold full gradients: no collective. A parameter
    without a gradient counts as zero.

    Args:
        model: See :func:`~opacus_fsdp_sync.grad_access.microbatch.resolve`.
        prefixes: Module prefixes; None: every module that owns parameters directly.

    Raises:
        ValueError: for an unknown prefix (see :func:`select`).
    """
    layout = resolve(model)
    names = list(layout.params)
    if prefixes is None:
        prefixes = list(dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n in names))
    groups = select(names, prefixes)
    replication = _replication(layout)
    squares: dict[str, torch.Tensor] = {}
    device = torch.device("cpu")
    for name, param in layout.params.items():
        if param.grad is not None:
            grad = _local(param.grad)
            device = grad.device
            norm = torch.linalg.vector_norm(grad.detach().float()).double()
            squares[name] = norm * norm / replication[name]
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = [sum((squares.get(n, zero) for n in members), zero) for members in groups.values()]
    sums.append(sum(squares.values(), zero))
    stacked = torch.stack([s.to(device) for s in sums])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout.record.capabilities.sharded and world > 1:
        dist.all_reduce(stacked)
    values = stacked.sqrt().tolist()
    return GradNorms(per_layer=dict(zip(groups, values[:-1])), total=values[-1])


def freeze_outside(
    model: nn.Module, prefixes: str | Iterable[str], *, set_to_none: bool = False
) -> int:
    """Zeroes the gradients of every parameter outside the target layers (local shards).

    Args:
        model: See :func:`~opacus_fsdp_sync.grad_access.microbatch.resolve`.
        prefixes: Module prefixes of the layers to keep training.
        set_to_none: Set those gradients to None instead of zero (every rank must agree).

    Returns:
        The number of parameters outside the targets (the same on every rank).

    Raises:
        ValueError: for an unknown prefix (see :func:`select`).
    """
    layout = resolve(model)
    keep = {n for members in select(layout.params, prefixes).values() for n in members}
    frozen = 0
    for name, param in layout.params.items():
        if name in keep:
            continue
        frozen += 1
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            _local(param.grad).zero_()
    logger.debug("[GradAccess] froze %d of %d parameters", frozen, len(layout.params))
    return frozen


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
        n: _local(p.grad).detach().clone()
        for n, p in layout.params.items()
        if n in names and p.grad is not None
    }
    return GradSnapshot(grads=grads, api=layout.api)


def _target(layout: GradLayout, snapshot: GradSnapshot) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Pairs each snapshot entry with its parameter, after checking name, API and shape."""
    full_both = not (_sharded(layout.api) or _sharded(snapshot.api))  # DDP and one device
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
        shape = _local(param.grad).shape if param.grad is not None else _local(param).shape
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
        local = _local(param.grad)
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
            _local(param.grad).copy_(value)
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
