"""The one place that touches private FSDP1 (``FullyShardedDataParallel``) state.

Verified on torch 2.13.0. FSDP1 ends its iteration at the end of every backward: the root's final
callback reshards, frees the unsharded flat parameters that a retained graph still points into,
and resets the pre-backward flags, so Opacus's second backward reads freed storage. With an
activations-only first pass (no parameter gradient, so no post-backward hook fires), keeping that
callback from being queued and putting every state back to IDLE lets the second backward run as a
normal one: parameters stay unsharded from the first pass, gradients are reduce-scattered once.
"""

from __future__ import annotations

import torch
from torch import nn

from ._fsdp2_internals import FSDPInternalsError

VERIFIED_TORCH_VERSIONS = ("2.13",)


def _fail(what: str) -> FSDPInternalsError:
    return FSDPInternalsError(
        f"opacus_fsdp_sync could not find {what} on torch {torch.__version__} (FSDP1 internals "
        f"verified on {', '.join(VERIFIED_TORCH_VERSIONS)}). Use FSDP2 (fully_shard), or pass "
        "sync_optimization=False (which FSDP1 ghost clipping cannot run without)."
    )


def _states(root: nn.Module) -> list:
    states = getattr(root, "_all_fsdp_states", None)
    if states is None:
        raise _fail("FullyShardedDataParallel._all_fsdp_states (call backward after a forward)")
    return list(states)


def hold_final_callback(root: nn.Module) -> bool:
    """Marks the root's post-backward callback as already queued; returns the previous flag."""
    if not hasattr(root, "_post_backward_callback_queued"):
        raise _fail("FullyShardedDataParallel._post_backward_callback_queued")
    previous = bool(root._post_backward_callback_queued)
    root._post_backward_callback_queued = True
    return previous


def reopen_backward(root: nn.Module, previous_flag: bool) -> None:
    """Puts every FSDP1 state back to IDLE with its pre-backward hook re-armed."""
    from torch.distributed.fsdp._common_utils import TrainingState

    for state in _states(root):
        state.training_state = TrainingState.IDLE
        handle = getattr(state, "_handle", None)
        if handle is not None:
            if not hasattr(handle, "_ran_pre_backward_hook"):
                raise _fail("FlatParamHandle._ran_pre_backward_hook")
            handle._ran_pre_backward_hook = False
    root._post_backward_callback_queued = previous_flag


def sharding_strategies(root: nn.Module) -> set[str]:
    """Names of the sharding strategies in use under ``root`` (``FULL_SHARD``, ...)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return {m.sharding_strategy.name for m in root.modules() if isinstance(m, FSDP)}


def uses_orig_params(root: nn.Module) -> bool:
    """Whether every FSDP1 instance under ``root`` was built with ``use_orig_params=True``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flags = []
    for m in root.modules():
        if isinstance(m, FSDP):
            if not hasattr(m, "_use_orig_params"):
                raise _fail("FullyShardedDataParallel._use_orig_params")
            flags.append(bool(m._use_orig_params))
    return all(flags)


# --- Gradient access (opacus_fsdp_sync.grad_access) ---------------------------------------


def handles(model: nn.Module) -> list:
    """The FSDP1 ``FlatParamHandle`` of every ``FullyShardedDataParallel`` under ``model``.

    Raises:
        FSDPInternalsError: if an instance has no ``_handle`` or a handle no ``flat_param``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    handles = []
    for state in FSDP.fsdp_modules(model):
        if not hasattr(state, "_handle"):
            raise _fail("FullyShardedDataParallel._handle")
        handle = state._handle
        if handle is None:
            continue
        if not hasattr(handle, "flat_param") or not hasattr(handle, "_use_unsharded_grad_views"):
            raise _fail("FlatParamHandle.flat_param / _use_unsharded_grad_views")
        handles.append(handle)
    return handles


def orig_params(handle) -> list[nn.Parameter]:
    """The original parameters (``use_orig_params=True``) viewing one handle's flat parameter."""
    flat = handle.flat_param
    params = getattr(flat, "_params", None)
    if params is None:
        raise _fail("FlatParameter._params (FSDP1 needs use_orig_params=True)")
    return list(params) + list(getattr(flat, "_shared_params", None) or [])


def unsharded_numel(handle) -> int:
    """Number of elements of a handle's unpadded unsharded flat parameter."""
    size = getattr(handle.flat_param, "_unpadded_unsharded_size", None)
    if size is None:
        raise _fail("FlatParameter._unpadded_unsharded_size")
    return size.numel()


def take_flat_grad(handle) -> torch.Tensor | None:
    """Detaches and returns a handle's flat gradient; clears it and its parameters' views."""
    flat = handle.flat_param
    grad, flat.grad = flat.grad, None
    for param in orig_params(handle):
        param.grad = None
    return grad


def put_flat_grad(handle, grad: torch.Tensor | None) -> None:
    """Sets an unsharded flat gradient (or None) and points the parameters' grads into it.

    FSDP1 itself assigns unsharded gradients to a sharded flat parameter through ``.data``
    (the ``.grad`` setter refuses the size mismatch); this does the same.
    """
    flat = handle.flat_param
    flat.grad = None
    if grad is not None:
        flat.grad = torch.empty_like(flat)
        flat.grad.data = grad
    handle._use_unsharded_grad_views()
