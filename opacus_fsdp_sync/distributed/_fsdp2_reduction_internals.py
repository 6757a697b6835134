"""The private FSDP2 state that the privacy check of the gradient reduction reads.

FSDP2 keeps how it reduces each unit's gradients on its ``FSDPParamGroup``: a divide factor, the
force-sum flag, the reduce-scatter communication object and an all-reduce hook. The public
setters (``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``,
``set_custom_reduce_scatter``, ``set_all_reduce_hook``) have no getters, so the check at
``make_private`` reads these attributes, behind the version gate like every other private read.
"""

from __future__ import annotations

from torch import nn

from . import version_gate
from ._fsdp2_internals import FSDPInternalsError, param_groups


def _builtin_reduce_scatters() -> tuple[type, ...]:
    """The reduce-scatter classes torch has: they choose where buffers live, and reduce as asked."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as comms

    names = ("DefaultReduceScatter", "ProcessGroupAllocReduceScatter", "SymmMemReduceScatter")
    return tuple(getattr(comms, n) for n in names if hasattr(comms, n))


def _group_overrides(group) -> list[str]:
    """What one ``FSDPParamGroup`` sets that may make its reduction other than the average."""
    found = []
    factor, force = group.gradient_divide_factor, group.force_sum_reduction_for_comms
    if factor is not None:
        found.append(f"gradient_divide_factor={factor}, force_sum_reduction_for_comms={force}")
    comm = group._reduce_scatter_comm
    if type(comm) not in _builtin_reduce_scatters():
        found.append(f"set_custom_reduce_scatter({type(comm).__name__})")
    hook = group._all_reduce_hook
    if hook is not None:
        name = getattr(hook, "__qualname__", None) or repr(hook)
        found.append(f"set_all_reduce_hook({name})")
    return found


def reduction_overrides(modules: list[nn.Module]) -> list[tuple[str, str]]:
    """Each FSDP2 unit under ``modules`` whose reduction may not be FSDP2's default average.

    Passes: FSDP2's defaults, HSDP's, torch's own reduce-scatter classes (they only choose
    where the buffers live) and ``set_force_sum_reduction_for_comms(True)`` without a divide
    factor (torch then sums and divides by the data-parallel size itself, the same average).
    Named: a divide factor (``set_gradient_divide_factor`` or the older
    ``set_reduce_scatter_divide_factor``), a custom reduce-scatter and an all-reduce hook
    (neither can be checked to average).

    Returns:
        ``(module name, what is set)`` pairs in module order (an outermost unit by its class).

    Raises:
        FSDPInternalsError: if a group lacks an attribute read (the check cannot be skipped).
    """
    from torch.distributed.fsdp import FSDPModule

    out: list[tuple[str, str]] = []
    for root in modules:
        for name, m in root.named_modules():
            for g in param_groups(m) if isinstance(m, FSDPModule) else ():
                with version_gate.private_access(
                    "the check of FSDP2's gradient reduction (make_private)",
                    "FSDPParamGroup.gradient_divide_factor / force_sum_reduction_for_comms / "
                    "_reduce_scatter_comm / _all_reduce_hook",
                    "Install a tested torch release; this privacy check cannot be turned off.",
                    cls=FSDPInternalsError,
                ):
                    found = _group_overrides(g)
                for how in found:
                    if (name or type(m).__name__, how) not in out:
                        out.append((name or type(m).__name__, how))
    return out
