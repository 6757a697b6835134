"""Whether a distributed layout can be made private, and whether it is distributed at all.

Opacus decides "distributed" from the type of the object passed to ``make_private``
(``DDP``, ``DPDDP`` or an ``FSDPModule``). A model sharded without a root unit (``fully_shard`` on
its layers only), or wrapped one level down, is then counted as one process: the expected batch
is not divided by the world size, and gradient and noise both come out ``1 / world_size`` of what
the accountant assumes. The engine decides from the layout instead, and refuses the layouts whose
noise it cannot calibrate: trainable parameters that no FSDP unit manages (each rank would step
them on its own gradient and its own noise) and a DDP wrapper below the model's top.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .controllers import UnsupportedConfigurationError
from .detect import DDP, FSDP1, FSDP2, DistributedRoot

_SHOWN = 4


def is_distributed(root: DistributedRoot) -> bool:
    """True when ``root`` names a distributed API (however deep its wrappers sit)."""
    return root.api in (FSDP2, FSDP1, DDP)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _listing(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _unmanaged_fsdp2(model: nn.Module) -> list[str]:
    from torch.distributed.tensor import DTensor

    return [n for n, p in _trainable(model) if not isinstance(p, DTensor)]


def _unmanaged_fsdp1(model: nn.Module, root: DistributedRoot) -> list[str]:
    managed = {id(p) for unit in root.modules for p in unit.parameters()}
    return [n for n, p in _trainable(model) if id(p) not in managed]


def check_layout(model: nn.Module, root: DistributedRoot) -> None:
    """Refuses a layout whose gradients or noise would differ between replicas.

    Args:
        model: The user's model, unwrapped from Opacus.
        root: What :func:`~.detect.get_fsdp_root_module` found in it.

    Raises:
        UnsupportedConfigurationError: naming the parameters or wrapper at fault and how to
            shard the model instead.
    """
    if root.api is None:
        nested = [n for n, m in model.named_modules() if isinstance(m, DistributedDataParallel)]
        if nested:
            raise UnsupportedConfigurationError(
                f"DistributedDataParallel wraps {_listing(nested)} but not the model passed to "
                "make_private: the engine would count the run as one process (no averaging over "
                "ranks, each rank its own noise). Pass the DDP-wrapped model itself: "
                "DistributedDataParallel(model)."
            )
        return
    if world_size() <= 1:
        return
    if root.api == FSDP2:
        plain = _unmanaged_fsdp2(model)
        if plain:
            raise UnsupportedConfigurationError(
                f"{len(plain)} trainable parameter(s) are not managed by FSDP2: "
                f"{_listing(plain)}. No rank reduces their gradients and each rank would add its "
                "own noise, so the replicas drift apart and the noise is not the accountant's. "
                "Call fully_shard on the module that owns them (or on the root, after the "
                "blocks: fully_shard(model)), or freeze them (requires_grad_(False))."
            )
    elif root.api == FSDP1:
        plain = _unmanaged_fsdp1(model, root)
        if plain:
            raise UnsupportedConfigurationError(
                f"{len(plain)} trainable parameter(s) lie outside every FullyShardedDataParallel "
                f"instance: {_listing(plain)}. Wrap the whole model "
                "(FullyShardedDataParallel(model, ...), as opacus_fsdp_sync.sharding.shard_model "
                "does) or freeze them."
            )


def world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
