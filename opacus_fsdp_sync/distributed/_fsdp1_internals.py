"""The one place that touches private FSDP1 (``FullyShardedDataParallel``) state.

Checked by the test-suite on the torch releases in
:data:`~opacus_fsdp_sync.distributed.version_gate.TESTED_TORCH_VERSIONS`.

FSDP1 ends its iteration at the end of every backward: the root's final
callback reshards, frees the unsharded flat parameters that a retained graph still points into,
and resets the pre-backward flags, so Opacus's second backward reads freed storage. With an
activations-only first pass (no parameter gradient, so no post-backward hook fires), keeping that
callback from being queued and putting every state back to IDLE lets the second backward run as a
normal one: parameters stay unsharded from the first pass, gradients are reduce-scattered once.
The one-backward hand-off (``reduce_clipped_gradients``) instead continues that backward with the
clipped gradients: FSDP1's own post-backward hooks and final callback, no second backward.
"""

from __future__ import annotations

import torch
from torch import nn

from . import version_gate
from ._fsdp2_internals import FSDPInternalsError

#: Kept for callers that read it: the releases the whole suite runs on.
VERIFIED_TORCH_VERSIONS = version_gate.TESTED_TORCH_VERSIONS


def _fail(what: str) -> FSDPInternalsError:
    return version_gate.internals_error(
        "ghost clipping under FSDP1",
        what,
        "Use FSDP2 (fully_shard), or install a tested torch release (FSDP1 ghost clipping has "
        "no fallback: upstream Opacus rejects FSDP1).",
        cls=FSDPInternalsError,
    )


def _states(root: nn.Module) -> list:
    states = getattr(root, "_all_fsdp_states", None)
    if states is None:
        raise _fail("FullyShardedDataParallel._all_fsdp_states (call backward after a forward)")
    return list(states)


def syncs_gradients(root: nn.Module) -> bool:
    """False inside the user's ``no_sync()`` (``FullyShardedDataParallel._sync_gradients``)."""
    flag = getattr(root, "_sync_gradients", None)
    if flag is None:
        raise _fail("FullyShardedDataParallel._sync_gradients")
    return bool(flag)


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


def _averages(hook, state, group) -> bool:
    """Whether an FSDP1 hook is torch's plain one with a state that divides by ``group``'s size."""
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks import default_hooks as hooks

    if hook not in (hooks.allreduce_hook, hooks.reduce_scatter_hook):
        return False
    if type(state) is not hooks.DefaultState:
        return False
    if dist.get_process_group_ranks(state.process_group) != dist.get_process_group_ranks(group):
        return False
    pre, post = state.gradient_predivide_factor, state.gradient_postdivide_factor
    divisor = (pre if pre > 1 else 1.0) * (post if post > 1 else 1.0)
    return abs(divisor - dist.get_world_size(group)) < 1e-9


def comm_hook_refusals(root: nn.Module) -> list[str]:
    """Each FSDP1 communication hook under ``root`` that may not average over the unit's ranks.

    Passes: no hook (FSDP1's own average), and torch's ``allreduce_hook`` /
    ``reduce_scatter_hook`` with a ``DefaultState`` of the unit's process group whose two
    divide factors multiply to its size. Everything else is named: the 16-bit compress hooks
    (each rank's clipped sum rounded before the noise), a state with other factors or another
    group, and any other hook (it may sum or keep state).

    Returns:
        One ``"<hook> (<state>)"`` entry per distinct hook and state.

    Raises:
        FSDPInternalsError: if a unit lacks ``_comm_hook`` / ``_comm_hook_state``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: list[str] = []
    for m in root.modules():
        if not isinstance(m, FSDP):
            continue
        with version_gate.private_access(
            "the check of FSDP1's communication hook (make_private)",
            "FullyShardedDataParallel._comm_hook / _comm_hook_state / process_group",
            "Install a tested torch release; this privacy check cannot be turned off.",
            cls=FSDPInternalsError,
        ):
            hook, state, group = m._comm_hook, m._comm_hook_state, m.process_group
        if hook is None or _averages(hook, state, group):
            continue
        name = getattr(hook, "__qualname__", None) or repr(hook)
        entry = f"{name} ({type(state).__name__})"
        if entry not in out:
            out.append(entry)
    return out


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


# --- One-backward hand-off (opacus_fsdp_sync.one_backward) -----------------------------------
#
# After the activations-only first pass every handle that took part is unsharded (its
# pre-backward hook all-gathered it, and no post-backward hook fired because no flat parameter
# received a gradient), its state was reopened to IDLE by ``reopen_backward`` and its handle is
# still ``BACKWARD_PRE``. The hand-off continues that backward as autograd would have: it writes
# the clipped gradients into each unsharded flat gradient through FSDP1's own unflatten views
# (alignment padding included), runs FSDP1's post-backward hook per handle (reduce dtype,
# pre/post-divide, reduce-scatter or NO_SHARD all-reduce, accumulation into the saved shard,
# reshard, sharded grad views) and then the root's end-of-backward callback. No all-gather.


def _private(owner, name: str):
    value = getattr(owner, name, None)
    if value is None:
        raise _fail_one_backward(f"{type(owner).__name__}.{name}")
    return value


def _fail_one_backward(what: str) -> FSDPInternalsError:
    return version_gate.internals_error(
        "the FSDP1 one-backward hand-off",
        what,
        "Pass one_backward=False to PrivacyEngine (the two-pass FSDP1 step), or use FSDP2.",
        cls=FSDPInternalsError,
    )


def _runtime():
    """FSDP1's runtime functions the hand-off drives (private module of torch)."""
    try:
        from torch.distributed.fsdp import _runtime_utils as runtime
        from torch.distributed.fsdp._common_utils import TrainingState
        from torch.distributed.fsdp._flat_param import HandleTrainingState
    except ImportError as err:
        raise _fail_one_backward("torch.distributed.fsdp._runtime_utils") from err
    for name in (
        "_post_backward_hook",
        "_post_backward_final_callback",
        "_reset_flat_param_grad_info_if_needed",
    ):
        _private(runtime, name)
    return runtime, TrainingState, HandleTrainingState


def _slots(handles: list) -> dict[tuple[int, str], tuple[object, int]]:
    """``(id(module), attribute) -> (handle, index in the flat parameter)`` for every use.

    A weight shared inside one flat parameter (FSDP1 keeps one copy) maps every use to the same
    index, so its uses' gradients add up there.
    """
    slots = {}
    for handle in handles:
        flat = handle.flat_param
        infos = _private(flat, "_param_infos")
        shared = getattr(flat, "_shared_param_infos", None)
        if shared is None:
            raise _fail_one_backward("FlatParameter._shared_param_infos")
        for i, (name, module, _) in enumerate(infos):
            slots[(id(module), name)] = (handle, i)
        for name, module, _, prim_name, prim_module, _ in shared:
            slots[(id(module), name)] = slots[(id(prim_module), prim_name)]
    return slots


def _flat_gradient(handle, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The unsharded flat gradient holding ``pieces`` (zeros elsewhere, padding included)."""
    flat = handle.flat_param
    size = _private(flat, "_unpadded_unsharded_size")
    if flat.numel() != size.numel():
        raise _fail_one_backward(
            "an unsharded FlatParameter after the first pass (it was resharded)"
        )
    unflat = _private(handle, "_get_unflat_views")
    requires = [p.requires_grad for p in _private(flat, "_params")]
    grad = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    views = list(unflat(grad))
    for i, g in pieces:
        if requires[i]:
            views[i].add_(g.reshape(views[i].shape).to(grad.dtype))
    return grad


@torch.no_grad()
def reduce_clipped_gradients(root: nn.Module, grads: dict) -> None:
    """Hands full clipped gradients to FSDP1's own post-backward, as a normal backward would.

    Call it after the activations-only first pass and ``reopen_backward``. Does what the second
    backward of the two-pass step does from its first pre-backward hook on: clears flat gradients
    whose original parameters' gradients were all set to None, adds each handle's clipped
    gradient to whatever unsharded gradient it holds (as AccumulateGrad would; the user's own
    ``no_sync()`` is refused before this point),
    runs FSDP1's post-backward hook per handle, then the root's final callback, so every handle
    ends resharded and IDLE with its sharded ``.grad`` set.

    Args:
        root: The root ``FullyShardedDataParallel`` module.
        grads: ``{key: (module, attribute, full gradient)}`` from
            :func:`~opacus_fsdp_sync.one_backward.clipped_gradients`.

    Raises:
        FSDPInternalsError: for a gradient FSDP1 does not manage, or missing internals (the
            message names the way out, ``one_backward=False``).
    """
    runtime, TrainingState, HandleTrainingState = _runtime()
    states = _states(root)
    if not getattr(root, "_is_root", False):
        raise _fail_one_backward("FullyShardedDataParallel._is_root on the outermost instance")
    handles = [s._handle for s in states if getattr(s, "_handle", None) is not None]
    slots = _slots(handles)
    pieces: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for module, name, g in grads.values():
        slot = slots.get((id(module), name))
        if slot is None:
            raise FSDPInternalsError(
                f"{type(module).__name__}.{name} received a clipped gradient but no FSDP1 flat "
                "parameter holds it; wrap every trainable parameter with FSDP1, or pass "
                "one_backward=False to PrivacyEngine."
            )
        pieces.setdefault(id(slot[0]), []).append((slot[1], g))
    # What the second backward's root pre-backward hook would do first.
    runtime._reset_flat_param_grad_info_if_needed(handles)
    for state in states:
        state.training_state = TrainingState.FORWARD_BACKWARD
    for state in reversed(states):  # the same order on every rank
        handle = getattr(state, "_handle", None)
        if handle is None or id(handle) not in pieces:
            continue
        if handle._training_state != HandleTrainingState.BACKWARD_PRE:
            raise _fail_one_backward(
                f"FlatParamHandle._training_state BACKWARD_PRE (got {handle._training_state})"
            )
        flat = handle.flat_param
        grad = _flat_gradient(handle, pieces[id(handle)])
        if flat.grad is not None:  # as AccumulateGrad: existing unsharded gradient + new
            if flat.grad.shape != grad.shape:
                raise _fail_one_backward("an unsharded FlatParameter.grad (or None)")
            grad += flat.grad
        flat.grad = grad
        runtime._post_backward_hook(state, handle, flat)
    runtime._post_backward_final_callback(root, root)


def end_backward_after_failure(root: nn.Module) -> None:
    """Puts every FSDP1 state back to IDLE after a hand-off raised.

    Raises:
        FSDPInternalsError: if FSDP1's states are not as on the tested torch releases.
    """
    from torch.distributed.fsdp._common_utils import TrainingState

    with version_gate.private_access(
        "recovering FSDP1 after a failed step",
        "FullyShardedDataParallel.training_state / FlatParamHandle._ran_pre_backward_hook",
        "The next step would be wrong: restart from a checkpoint.",
        cls=FSDPInternalsError,
    ):
        for state in _states(root):
            state.training_state = TrainingState.IDLE
            handle = getattr(state, "_handle", None)
            if handle is not None:
                handle._ran_pre_backward_hook = False
        root._post_backward_callback_queued = False
