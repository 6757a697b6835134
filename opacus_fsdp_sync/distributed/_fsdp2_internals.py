"""The one place that touches private FSDP2 (``fully_shard``) attributes.

Checked by the test-suite on the torch releases in
:data:`~opacus_fsdp_sync.distributed.version_gate.TESTED_TORCH_VERSIONS` (2.13 and 2.15), with
branches for the torch 2.6-2.8 layout (singular ``_fsdp_param_group``). Every accessor validates
what it reads and raises :class:`FSDPInternalsError` naming the attribute, the feature and the
torch version, rather than silently doing nothing: a missed gradient clear would leak unclipped
gradients into a private update.

Where an unsynchronised (sync off) gradient lives changed in torch 2.15
(:func:`unsynced_grad_layout`):

- up to 2.14 (``"separate"``): on the unsharded parameter's ``.grad``, or, when the reduce dtype
  differs from the parameter dtype, on the writable ``FSDPParam.unsharded_accumulated_grad``
  (``to_accumulated_grad_if_needed`` moves it there after each backward);
- from 2.15 (``"leaf"``): always on the unsharded parameter's ``.grad``, in the reduce dtype after
  FSDP2's post-backward (the parameter's ``grad_dtype`` says which dtype autograd may accumulate
  in); ``unsharded_accumulated_grad`` is a read-only alias of that same tensor, so reading both
  would count the gradient twice.

Callers get the same functions on every release; gradients taken from an ``FSDPParam`` are an
opaque pair (``(grad, accumulated grad)``, the second always None from 2.15 on).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator

import torch
from torch import nn

from . import version_gate
from .version_gate import TorchInternalsError

logger = logging.getLogger(__name__)

#: Kept for callers that read it: the releases the whole suite runs on.
VERIFIED_TORCH_VERSIONS = version_gate.TESTED_TORCH_VERSIONS

SEPARATE = "separate"
LEAF = "leaf"

_REMEDY = (
    "Pass sync_optimization=False to PrivacyEngine to run upstream Opacus unchanged, or install "
    "a tested torch release."
)


class FSDPInternalsError(TorchInternalsError):
    """Raised when FSDP (FSDP2 or FSDP1) internals are not as on the tested torch releases."""


_FEATURE = "the FSDP2 sync-skipping step"


def _fail(what: str, feature: str = _FEATURE) -> FSDPInternalsError:
    return version_gate.internals_error(feature, what, _REMEDY, cls=FSDPInternalsError)


def _access(what: str, feature: str = _FEATURE):
    """A ``with`` block in which an ``AttributeError`` becomes a versioned error."""
    return version_gate.private_access(feature, what, _REMEDY, cls=FSDPInternalsError)


@functools.cache
def unsynced_grad_layout() -> str:
    """Where FSDP2 keeps an unsynchronised gradient on this torch: ``"separate"`` or ``"leaf"``.

    See the module docstring. Decided from ``FSDPParam`` itself, not from the version string, so
    a release between the tested ones is handled by what it has.

    Raises:
        FSDPInternalsError: if ``FSDPParam`` looks like neither layout.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError as err:
        raise _fail("torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam") from err
    accumulated = inspect.getattr_static(FSDPParam, "unsharded_accumulated_grad", None)
    if hasattr(FSDPParam, "to_accumulated_grad_if_needed") and not isinstance(
        accumulated, property
    ):
        return SEPARATE  # torch <= 2.14: a writable instance attribute
    if isinstance(accumulated, property) or accumulated is None:
        return LEAF  # torch >= 2.15: the gradient stays on the unsharded parameter
    raise _fail("FSDPParam.unsharded_accumulated_grad as an attribute or a read-only property")


def param_groups(module: nn.Module) -> list:
    """Returns the ``FSDPParamGroup`` objects owned by one FSDP2 module (possibly empty).

    Args:
        module: A module on which ``fully_shard`` was called.

    Raises:
        FSDPInternalsError: if the FSDP state has neither known attribute.
    """
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
    with _access("FSDPParamGroup.reduce_grads / all_reduce_grads"):
        group.reduce_grads, group.all_reduce_grads = flags


def unsharded_param(fsdp_param) -> nn.Parameter | None:
    """The unsharded parameter autograd accumulates into, or None before FSDP's lazy init."""
    return getattr(fsdp_param, "_unsharded_param", None)


def _fits_grad_dtype(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in a dtype ``param.grad`` accepts (torch >= 2.15 checks ``grad_dtype``)."""
    allowed = getattr(param, "grad_dtype", param.dtype)
    if allowed is None or grad.dtype == allowed:
        return grad
    return grad.to(allowed)  # what FSDP2's post-backward does to a not yet upcast gradient


def take_unsharded_grads(fsdp_param) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Detaches and returns every unsynchronised gradient an ``FSDPParam`` holds.

    Returns:
        ``(unsharded_param.grad, unsharded_accumulated_grad)``, both now cleared on the
        ``FSDPParam``. The second exists up to torch 2.14 when the reduce dtype differs from the
        parameter dtype (e.g. bf16 params with fp32 reduce) and is always None from 2.15 on.
        Treat the pair as opaque: give it back with :func:`put_unsharded_grads`, read it with
        :func:`merge_unsharded_grads`.

    Raises:
        FSDPInternalsError: if the layout is not as on the tested torch releases.
    """
    layout = unsynced_grad_layout()
    param = unsharded_param(fsdp_param)
    grad = None
    if param is not None:
        grad, param.grad = param.grad, None
    if layout == LEAF:
        return grad, None
    with _access("a writable FSDPParam.unsharded_accumulated_grad"):
        acc, fsdp_param.unsharded_accumulated_grad = fsdp_param.unsharded_accumulated_grad, None
    return grad, acc


def put_unsharded_grads(fsdp_param, grads: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Puts back gradients taken by :func:`take_unsharded_grads` (replacing what is there).

    Raises:
        FSDPInternalsError: if the layout is not as on the tested torch releases, or the pair
            holds an accumulated gradient that this torch has no place for.
    """
    grad, acc = grads
    param = unsharded_param(fsdp_param)
    if param is None:
        if grad is not None or acc is not None:
            raise _fail("FSDPParam._unsharded_param (after FSDP's lazy init)")
        return
    if unsynced_grad_layout() == LEAF:
        if acc is not None:  # a pair from another torch release cannot reach here
            raise _fail("a place for a separate unsharded accumulated gradient")
        param.grad = None if grad is None else _fits_grad_dtype(param, grad)
        return
    param.grad = grad
    with _access("a writable FSDPParam.unsharded_accumulated_grad"):
        fsdp_param.unsharded_accumulated_grad = acc


def merge_unsharded_grads(
    grads: tuple[torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor | None:
    """One full gradient from a pair of :func:`take_unsharded_grads` (no copy when one is set).

    Up to torch 2.14 both parts can be set (a backward after the accumulated one, not yet folded
    in by FSDP2's post-backward); the sum is in the accumulated gradient's (reduce) dtype.
    """
    grad, acc = grads
    if grad is None or acc is None:
        return acc if grad is None else grad
    return acc + grad.to(acc.dtype)


def unsynced_grad(fsdp_param) -> torch.Tensor | None:
    """The full unsynchronised gradient an ``FSDPParam`` holds, without taking it (no copy).

    Raises:
        FSDPInternalsError: if the layout is not as on the tested torch releases.
    """
    param = unsharded_param(fsdp_param)
    grad = None if param is None else param.grad
    if unsynced_grad_layout() == LEAF:
        return grad  # unsharded_accumulated_grad is this same tensor
    with _access("FSDPParam.unsharded_accumulated_grad"):
        acc = fsdp_param.unsharded_accumulated_grad
    return merge_unsharded_grads((grad, acc))


def holds_unsharded_grad(fsdp_param) -> bool:
    """True when the ``FSDPParam`` holds any unsharded (unreduced) gradient."""
    param = unsharded_param(fsdp_param)
    if param is not None and param.grad is not None:
        return True
    if unsynced_grad_layout() == LEAF:
        return False
    with _access("FSDPParam.unsharded_accumulated_grad"):
        return fsdp_param.unsharded_accumulated_grad is not None


def get_reshard_after_backward(group) -> bool:
    """The group's ``reshard_after_backward`` flag (public setter, private getter)."""
    try:
        return bool(group.reshard_after_backward)
    except AttributeError as err:
        raise _fail("FSDPParamGroup.reshard_after_backward") from err


def set_reshard_after_backward(group, flag: bool) -> None:
    """Restores a flag saved by :func:`get_reshard_after_backward`."""
    with _access("FSDPParamGroup.reshard_after_backward"):
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


# --- Gradient access (opacus_fsdp_sync.grad_access) ------------------------------------------


_GRAD_ACCESS = "gradient access (opacus_fsdp_sync.grad_access) under FSDP2"


def param_location(fsdp_param) -> tuple[nn.Module, str]:
    """The module and attribute name under which an ``FSDPParam`` is registered.

    Raises:
        FSDPInternalsError: if ``FSDPParam._module_info`` lacks ``module`` / ``param_name``.
    """
    info = getattr(fsdp_param, "_module_info", None)
    module = getattr(info, "module", None)
    name = getattr(info, "param_name", None)
    if module is None or name is None:
        raise _fail("FSDPParam._module_info.module / .param_name", _GRAD_ACCESS)
    return module, name


def handed_dtensors(modules: list[nn.Module]) -> dict[int, bool]:
    """Whether each parameter FSDP2 manages was a DTensor already when FSDP2 took it.

    A parameter handed to ``fully_shard`` (or FSDP's ``replicate``) as a DTensor is tensor
    parallel: FSDP2 keeps its placements on extra mesh dimensions, and shows them alone while
    the unit is unsharded. Reads ``FSDPParam.is_dtensor`` and ``FSDPParam._module_info``; checked
    on torch 2.13 (the suite also runs on 2.15).

    Returns:
        ``{id(parameter as its module holds it now, sharded or not): handed a DTensor}``.

    Raises:
        FSDPInternalsError: if ``FSDPParam`` lacks ``is_dtensor`` or ``_module_info``.
    """
    out: dict[int, bool] = {}
    for group in iter_param_groups(modules):
        for fp in fsdp_params(group):
            module, name = param_location(fp)
            with _access("FSDPParam.is_dtensor", "the layout check (tensor parallelism)"):
                out[id(getattr(module, name))] = bool(fp.is_dtensor)
    return out


# --- Recovery after a failed step -------------------------------------------------------------


def reset_after_failure(modules: list[nn.Module]) -> None:
    """Drops every unreduced gradient and resets FSDP2's per-iteration state.

    Uses the public ``FSDPModule.reset_iter_state()`` on the root (torch 2.12 and later; it must
    be called on the root and raises ``RuntimeError`` elsewhere). Unsynchronised gradients are
    dropped first, so a hand-off that failed after setting some leaves nothing to be added into
    the next step.

    Args:
        modules: The outermost FSDP2 modules.

    Raises:
        FSDPInternalsError: if this torch has no ``reset_iter_state`` or no root could be reset.
    """
    feature = "recovering FSDP2 after a failed step"
    remedy = "The next step would be wrong: restart from a checkpoint."
    for group in iter_param_groups(modules):
        for fp in fsdp_params(group):
            take_unsharded_grads(fp)
    last_error: RuntimeError | None = None
    reset_any = False
    for module in modules:
        reset = getattr(module, "reset_iter_state", None)
        if reset is None:
            raise version_gate.internals_error(
                feature, "FSDPModule.reset_iter_state()", remedy, cls=FSDPInternalsError
            )
        try:
            reset()
            reset_any = True
        except RuntimeError as err:  # not the root FSDP state: reset through the root
            last_error = err
    if reset_any:
        return
    raise version_gate.internals_error(
        feature,
        "a root FSDP module that reset_iter_state() accepts",
        remedy,
        cls=FSDPInternalsError,
    ) from last_error


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
