"""The private FSDP2 state that the one-backward hand-off touches.

The hand-off (:class:`~opacus_fsdp_sync.apis.fsdp2.FSDP2Handoff`) delivers each parameter group's
clipped gradients to FSDP2's own post-backward, in backward order, then runs each root's final
backward callback. It indexes the groups, sets the unsharded gradient as autograd would, calls
``FSDPParamGroup.post_backward`` and ``FSDPState._root_post_backward_final_callback``: private
attributes, checked by the test-suite on the torch releases in
:data:`~opacus_fsdp_sync.distributed.version_gate.TESTED_TORCH_VERSIONS` (2.13 and 2.15). What it
does not find raises :class:`FSDPInternalsError` naming the attribute, the torch version and the
way out (the two-pass step). Where an unsynchronised gradient lives is decided in
:mod:`._fsdp2_internals`.
"""

from __future__ import annotations

import torch
from torch import nn

from . import version_gate
from ._fsdp2_internals import (
    LEAF,
    FSDPInternalsError,
    fsdp_params,
    iter_param_groups,
    unsharded_param,
    unsynced_grad_layout,
)

_HANDOFF = "the FSDP2 one-backward hand-off"
_HANDOFF_REMEDY = (
    "Pass one_backward=False to PrivacyEngine (the two-pass step), or install a tested torch "
    "release."
)


def _fail(what: str) -> FSDPInternalsError:
    return version_gate.internals_error(_HANDOFF, what, _HANDOFF_REMEDY, cls=FSDPInternalsError)


def _access(what: str):
    """A ``with`` block in which an ``AttributeError`` becomes a versioned error."""
    return version_gate.private_access(_HANDOFF, what, _HANDOFF_REMEDY, cls=FSDPInternalsError)


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

    The gradient is cast to the parameter dtype, the dtype autograd produces in a reducing
    backward; an unsynchronised gradient already there (the user's own micro-batches, in the
    reduce dtype) is added to. From torch 2.15 on, FSDP2's pre-backward of a reducing backward
    lifts the unsharded parameter's ``grad_dtype`` restriction so that autograd may store such a
    gradient; this does the same where needed.

    Raises:
        FSDPInternalsError: if the unsharded parameter is missing or of another shape.
    """
    up = unsharded_param(fp)
    if up is None or tuple(up.shape) != tuple(grad.shape):
        raise _fail("FSDPParam._unsharded_param of the gradient's shape")
    grad = grad.to(up.dtype)
    if up.grad is not None:  # user's unsynced micro-batches
        up.grad = up.grad + grad
        return
    if unsynced_grad_layout() == LEAF and getattr(up, "grad_dtype", None) not in (None, grad.dtype):
        up.grad_dtype = None  # FSDP2's post-backward sets it back after the reduce-scatter
    up.grad = grad


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

    From torch 2.15 on the callback expects the backward's finalisation mode to have been
    recorded by the root's pre-backward, which the first pass's own end of backward cleared;
    it is recorded again here, as the pre-backward would.

    Raises:
        FSDPInternalsError: if a root lacks the callback.
    """
    for module in modules:
        state = module._get_fsdp_state()
        if getattr(state, "_is_root", False):
            if not hasattr(state, "_root_post_backward_final_callback"):
                raise _fail("FSDPState._root_post_backward_final_callback")
            ctx = getattr(state, "_state_ctx", None)
            if hasattr(ctx, "manual_backward_finalization_active"):  # torch >= 2.15
                with _access("FSDPStateContext.manual_backward_finalization"):
                    if ctx.manual_backward_finalization_active is None:
                        ctx.manual_backward_finalization_active = ctx.manual_backward_finalization
            state._root_post_backward_final_callback()


def unmanaged_param_error(param: torch.Tensor) -> FSDPInternalsError:
    """The error for a parameter that received a clipped gradient but is not FSDP2's.

    Not a version problem: the message names the way out, not the torch release.
    """
    return FSDPInternalsError(
        f"a parameter of shape {tuple(param.shape)} that received a clipped gradient is "
        "not managed by FSDP2; shard every trainable parameter or pass "
        "one_backward=False to PrivacyEngine."
    )
