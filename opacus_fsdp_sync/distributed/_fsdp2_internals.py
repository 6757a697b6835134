"""The one place that touches private FSDP2 (``fully_shard``) attributes.

Checked on torch 2.6 layouts (singular ``_fsdp_param_group``) and torch 2.13.0 (plural
``_fsdp_param_groups``). Every accessor validates what it reads and raises
:class:`FSDPInternalsError` naming the attribute and the torch version, rather than silently doing
nothing: a missed gradient clear would leak unclipped gradients into a private update.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: torch releases (major.minor) on which these accessors were verified by the test-suite.
VERIFIED_TORCH_VERSIONS = ("2.13",)
_warned_unverified = False


class FSDPInternalsError(RuntimeError):
    """Raised when FSDP2 internals do not look as this torch release was verified to have them."""


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _fail(what: str) -> FSDPInternalsError:
    return FSDPInternalsError(
        f"opacus_fsdp_sync could not find {what} on torch {torch.__version__} (verified on "
        f"{', '.join(VERIFIED_TORCH_VERSIONS)}). Pass sync_optimization=False to PrivacyEngine "
        "to run upstream Opacus unchanged, or install a verified torch release."
    )


def _warn_if_unverified() -> None:
    global _warned_unverified
    if not _warned_unverified and _torch_minor() not in VERIFIED_TORCH_VERSIONS:
        _warned_unverified = True
        warnings.warn(
            f"opacus_fsdp_sync: FSDP2 internals were verified on torch "
            f"{', '.join(VERIFIED_TORCH_VERSIONS)}, this is {torch.__version__}; the structure "
            "checks passed, but run the exactness tests before trusting results.",
            stacklevel=3,
        )


def param_groups(module: nn.Module) -> list:
    """Returns the ``FSDPParamGroup`` objects owned by one FSDP2 module (possibly empty).

    Args:
        module: A module on which ``fully_shard`` was called.

    Raises:
        FSDPInternalsError: if the FSDP state has neither known attribute.
    """
    _warn_if_unverified()
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise _fail(f"_get_fsdp_state() on {type(module).__name__}")
    state = get_state()
    if hasattr(state, "_fsdp_param_groups"):  # torch >= 2.9 (plural; may hold several)
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):  # torch 2.6 - 2.8 (one group or None)
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise _fail("FSDPState._fsdp_param_groups / _fsdp_param_group")


def iter_param_groups(modules: list[nn.Module]) -> Iterator:
    """Yields every ``FSDPParamGroup`` under ``modules`` once (FSDP modules found recursively)."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                for group in param_groups(m):
                    if id(group) not in seen:
                        seen.add(id(group))
                        yield group


def fsdp_params(group) -> list:
    """Returns the ``FSDPParam`` list of one group."""
    params = getattr(group, "fsdp_params", None)
    if params is None:
        raise _fail("FSDPParamGroup.fsdp_params")
    return list(params)


def get_sync_flags(group) -> tuple[bool, bool]:
    """Returns ``(reduce_grads, all_reduce_grads)`` of a group: the user's sync settings."""
    try:
        return bool(group.reduce_grads), bool(group.all_reduce_grads)
    except AttributeError as err:
        raise _fail("FSDPParamGroup.reduce_grads / all_reduce_grads") from err


def set_sync_flags(group, flags: tuple[bool, bool]) -> None:
    """Restores ``(reduce_grads, all_reduce_grads)`` saved by :func:`get_sync_flags`."""
    group.reduce_grads, group.all_reduce_grads = flags


def unsharded_param(fsdp_param) -> nn.Parameter | None:
    """The unsharded parameter autograd accumulates into, or None before FSDP's lazy init."""
    return getattr(fsdp_param, "_unsharded_param", None)


def take_unsharded_grads(fsdp_param) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Detaches and returns ``(unsharded_param.grad, unsharded_accumulated_grad)``.

    Both are set to None on the ``FSDPParam``. The second exists when the reduce dtype differs
    from the parameter dtype (e.g. bf16 params with fp32 reduce).
    """
    if not hasattr(fsdp_param, "unsharded_accumulated_grad"):
        raise _fail("FSDPParam.unsharded_accumulated_grad")
    param = unsharded_param(fsdp_param)
    grad = None
    if param is not None:
        grad, param.grad = param.grad, None
    acc, fsdp_param.unsharded_accumulated_grad = fsdp_param.unsharded_accumulated_grad, None
    return grad, acc


def put_unsharded_grads(fsdp_param, grads: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Puts back gradients taken by :func:`take_unsharded_grads`."""
    grad, acc = grads
    param = unsharded_param(fsdp_param)
    if param is not None:
        param.grad = grad
    fsdp_param.unsharded_accumulated_grad = acc


def holds_unsharded_grad(fsdp_param) -> bool:
    """True when the ``FSDPParam`` holds any unsharded (unreduced) gradient."""
    param = unsharded_param(fsdp_param)
    return (param is not None and param.grad is not None) or getattr(
        fsdp_param, "unsharded_accumulated_grad", None
    ) is not None


def get_reshard_after_backward(group) -> bool:
    """The group's ``reshard_after_backward`` flag (public setter, private getter)."""
    try:
        return bool(group.reshard_after_backward)
    except AttributeError as err:
        raise _fail("FSDPParamGroup.reshard_after_backward") from err


def set_reshard_after_backward(group, flag: bool) -> None:
    """Restores a flag saved by :func:`get_reshard_after_backward`."""
    group.reshard_after_backward = flag


def unsharded_bytes(modules: list[nn.Module]) -> int:
    """Bytes of all unsharded parameters (in their compute dtype) under ``modules``.

    That is what keeping every unit unsharded between the two backward passes holds per rank.
    """
    total = 0
    for group in iter_param_groups(modules):
        for fp in fsdp_params(group):
            size = getattr(fp, "_orig_size", None)
            if size is None:
                raise _fail("FSDPParam._orig_size")
            dtype = getattr(fp, "param_dtype", None) or fp.sharded_param.dtype
            total += size.numel() * torch.empty((), dtype=dtype).element_size()
    return total


# --- Gradient access (opacus_fsdp_sync.grad_access), checked on torch 2.13.0 -----------------


def param_location(fsdp_param) -> tuple[nn.Module, str]:
    """The module and attribute name under which an ``FSDPParam`` is registered.

    Raises:
        FSDPInternalsError: if ``FSDPParam._module_info`` lacks ``module`` / ``param_name``.
    """
    info = getattr(fsdp_param, "_module_info", None)
    module = getattr(info, "module", None)
    name = getattr(info, "param_name", None)
    if module is None or name is None:
        raise _fail("FSDPParam._module_info.module / .param_name")
    return module, name


# --- One-backward hand-off (opacus_fsdp_sync.one_backward), checked on torch 2.13.0 -----------


def param_group_index(modules: list[nn.Module]) -> tuple[list, dict[int, tuple[int, object]]]:
    """FSDP2's parameter groups (backward order last) and ``{id(param): (group index, FSDPParam)}``.

    Both the sharded and the unsharded parameter of each ``FSDPParam`` are indexed, so a
    parameter is found whichever of them its module has registered now.
    """
    groups = list(iter_param_groups(modules))
    index: dict[int, tuple[int, object]] = {}
    for i, group in enumerate(groups):
        for fp in fsdp_params(group):
            index[id(fp.sharded_param)] = (i, fp)
            up = unsharded_param(fp)
            if up is not None:
                index[id(up)] = (i, fp)
    return groups, index


def set_unsharded_grad(fp, grad: torch.Tensor) -> None:
    """Adds ``grad`` (a full gradient) to the unsharded gradient of ``fp``, as autograd would.

    Raises:
        FSDPInternalsError: if the unsharded parameter is missing or of another shape.
    """
    up = unsharded_param(fp)
    if up is None or tuple(up.shape) != tuple(grad.shape):
        raise _fail("FSDPParam._unsharded_param of the gradient's shape")
    grad = grad.to(up.dtype)
    up.grad = grad if up.grad is None else up.grad + grad  # user's unsynced micro-batches


def group_post_backward(group) -> None:
    """FSDP2's own post-backward of one group: reduce-scatter (or accumulate) and reshard.

    Raises:
        FSDPInternalsError: if the group has no ``post_backward``.
    """
    if not hasattr(group, "post_backward"):
        raise _fail("FSDPParamGroup.post_backward")
    group.post_backward()


def finish_backward(modules: list[nn.Module]) -> None:
    """Each root's final backward callback: FSDP2 waits for its reductions and goes idle.

    Raises:
        FSDPInternalsError: if a root lacks the callback.
    """
    for module in modules:
        state = module._get_fsdp_state()
        if getattr(state, "_is_root", False):
            if not hasattr(state, "_root_post_backward_final_callback"):
                raise _fail("FSDPState._root_post_backward_final_callback")
            state._root_post_backward_final_callback()


def unmanaged_param_error(param: torch.Tensor) -> FSDPInternalsError:
    """The error for a parameter that received a clipped gradient but is not FSDP2's."""
    return FSDPInternalsError(
        f"a parameter of shape {tuple(param.shape)} that received a clipped gradient is "
        "not managed by FSDP2; shard every trainable parameter or pass "
        "one_backward=False to PrivacyEngine."
    )


def swap_local(dt: torch.Tensor, local: torch.Tensor) -> None:
    """Makes the DTensor ``dt`` hold ``local`` as its local tensor (no autograd, no copy).

    The old local tensor is dropped, with everything it kept alive (FSDP2's sharded gradients
    are views of its reduce-scatter output: ``Tensor.set_`` would move the data but keep that
    output alive through ``_base``). About 0.2 us, against 4 us for a new ``DTensor(local, spec)``
    and 24 us for ``DTensor.from_local``.

    Args:
        dt: A DTensor (the gradient whose data moves).
        local: Its new local tensor: same shape, dtype and device as the old one.

    Raises:
        FSDPInternalsError: if ``dt`` has no ``_local_tensor`` or ``local`` does not match it.
    """
    old = getattr(dt, "_local_tensor", None)
    if not isinstance(old, torch.Tensor):
        raise _fail("DTensor._local_tensor (the local shard of a gradient)")
    if (old.shape, old.dtype, old.device) != (local.shape, local.dtype, local.device):
        raise ValueError(
            f"swap_local: new local tensor {tuple(local.shape)} {local.dtype} {local.device} "
            f"does not match the old {tuple(old.shape)} {old.dtype} {old.device}"
        )
    dt._local_tensor = local
