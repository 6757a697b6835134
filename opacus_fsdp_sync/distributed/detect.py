"""Which distributed API wraps a model, and which of its modules to control."""

from __future__ import annotations

from typing import NamedTuple

from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .tensor_parallel import on_tp_mesh
from .version_gate import internals_error

#: The API names :func:`get_fsdp_root_module` can report.
FSDP2, FSDP1, DDP, TP = "fsdp2", "fsdp1", "ddp", "tp"


class DistributedRoot(NamedTuple):
    """The modules to control and the API in use (``None`` for a single-device model)."""

    modules: list[nn.Module]
    api: str | None


def _unwrap(module: object) -> nn.Module:
    """Returns the user's model behind an Opacus GradSampleModule or hooks object."""
    while isinstance(module, AbstractGradSampleHooks):
        module = module._module
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"get_fsdp_root_module expects an nn.Module, an Opacus GradSampleModule or an Opacus "
            f"hooks object; got {type(module).__name__}."
        )
    return module


def _outermost(model: nn.Module, cls: type) -> list[nn.Module]:
    """Every module of type ``cls`` in ``model`` that has no ancestor of that type."""
    if isinstance(model, cls):
        return [model]
    found: list[nn.Module] = []
    for child in model.children():
        found.extend(_outermost(child, cls))
    return found


def _get_fsdp_root_module(module: object) -> DistributedRoot:
    """Finds the distributed wrapper(s) of a model and the API in use.

    Args:
        module: an Opacus GradSampleModule, a non-wrapping Opacus hooks object
            (``wrap_model=False``) or a bare model.

    Returns:
        ``(modules, api)``: the outermost FSDP2 modules (several when only blocks are sharded
        and the root is not), the outermost FSDP1 instances, the DDP module, or the model with
        tensor-parallel layers and no FSDP (``"tp"``); ``api`` is ``"fsdp2"``, ``"fsdp1"``,
        ``"ddp"``, ``"tp"`` or ``None`` (``modules`` then empty).
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    model = _unwrap(module)
    if isinstance(model, DistributedDataParallel):
        return DistributedRoot([model], DDP)
    fsdp2 = _outermost(model, FSDPModule)
    if fsdp2:
        return DistributedRoot(fsdp2, FSDP2)
    fsdp1 = _outermost(model, FullyShardedDataParallel)
    if fsdp1:
        return DistributedRoot(fsdp1, FSDP1)
    if any(on_tp_mesh(p) for p in model.parameters()):
        return DistributedRoot([model], TP)
    return DistributedRoot([], None)


def composable_apis(module: nn.Module) -> frozenset[str]:
    """The composable APIs applied to ``module`` itself (``"fully_shard"``, ``"replicate"``).

    Read from torch's composable-API registry (``torch.distributed._composable._get_registry``,
    exported there since the composable APIs appeared; checked on torch 2.13, and the suite runs
    on 2.15). Both torch's DDP-based ``replicate`` (``torch.distributed._composable.replicate``)
    and its FSDP-based twin (``torch.distributed._composable.replicate_with_fsdp``) register as
    ``"replicate"``; the twin's modules are also ``FSDPModule`` s.

    Raises:
        TorchInternalsError: when this torch has no ``_get_registry``: the layout cannot be
            checked, so it is not silently accepted.
    """
    try:
        from torch.distributed._composable import _get_registry
    except ImportError as err:
        raise internals_error(
            "checking the layout for torch's composable replicate",
            "torch.distributed._composable._get_registry",
            "Install a tested torch release.",
        ) from err
    return frozenset(_get_registry(module) or ())


def ddp_replicated_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that torch's DDP-based composable ``replicate`` manages.

    Modules of the FSDP-based ``replicate`` are ``FSDPModule`` s, an FSDP2 layout, and are not
    reported.

    Returns:
        The module names, outermost first (``""`` is the model itself).
    """
    from torch.distributed.fsdp import FSDPModule

    return [
        name
        for name, m in model.named_modules()
        if "replicate" in composable_apis(m) and not isinstance(m, FSDPModule)
    ]


#: Public alias of :func:`_get_fsdp_root_module`.
get_fsdp_root_module = _get_fsdp_root_module
