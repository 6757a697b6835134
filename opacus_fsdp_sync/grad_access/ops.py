"""Per-layer operations on synced gradients: views, norms, freezing.

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


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
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
    return {n: local_shard(p.grad) for n, p in layout.params.items() if p.grad is not None}


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


def sharded_api(api: str | None) -> bool:
    """Whether ``api`` shards parameters (each rank's gradient is a part)."""
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
            grad = local_shard(param.grad)
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
            local_shard(param.grad).zero_()
    logger.debug("[GradAccess] froze %d of %d parameters", frozen, len(layout.params))
    return frozen
