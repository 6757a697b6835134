"""Clipped gradients from the first pass and their hand-off, instead of a second backward."""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from ..layers import room_for, room_named
from ..layers.linear import clipped_sum, input_key, shared_scaled_inputs

logger = logging.getLogger(__name__)


class OneBackwardUnavailable(RuntimeError):
    """This model or API cannot take the one-backward path (the two-pass step runs instead)."""


def clipped_gradients(
    kept,
    coef,
    loss_reduction,
    type_of,
    *,
    fused_kernels: bool | None = None,
    sequence_group=lambda module: None,
) -> dict[tuple[int, str], tuple]:
    """Clipped weight gradients of every kept layer.

    Args:
        kept: ``(module, inputs, grad_out)`` per layer, as the first pass left them (``grad_out``
            the raw gradient of the reduced loss w.r.t. the layer's output, batch first), or
            ``(module, None, per-sample gradients by parameter name)`` for a layer that
            materialised them in its norm (``Linear`` where cheaper, RMSNorm-like layers), from
            the same raw output gradient (scaled here like the others).
        coef: Per-sample clipping coefficients ``(N,)``.
        loss_reduction: ``"mean"`` or ``"sum"``.
        type_of: Maps a module to the layer type Opacus sees (FSDP2 classes to their original).
        fused_kernels: The option of that name: a room's kernel that folds the coefficients in
            (:meth:`~..layers.registry.LayerRoom.clipped_grad_folded`) where it applies.
        sequence_group: Maps a module to the group its input is split over along the tokens
            (the hooks' :meth:`~..hooks.contract.StepHooks.sequence_group`), for the rooms that
            sum sequence shards.

    Returns:
        ``{(id(module), name): (module, name, gradient)}``, summed over a layer's calls; the
        caller sums shared weights.

    Each layer's gradient is its room's :meth:`~..layers.registry.LayerRoom.clipped_grad`
    (:func:`..layers.room_for`).

    Raises:
        OneBackwardUnavailable: for a layer without a direct formula whose parameters are not
            plain tensors here (the generic path needs their full values).
    """
    out = {}
    scales: dict[tuple, torch.Tensor] = {}

    def scale_for(t: torch.Tensor) -> torch.Tensor:
        """``coef`` on ``t``'s device, times the batch size for a mean loss.

        In fp32, or fp64 for fp64 tensors (fp32 coefficients left an fp64 model's clipped
        gradients at fp32 precision, 1e-8 off the clip-each-sample loop).
        """
        wide = torch.promote_types(t.dtype, torch.float32)
        key = (t.device, t.shape[0], wide)
        if key not in scales:
            scale = coef.to(device=t.device, dtype=wide)
            scales[key] = scale * t.shape[0] if loss_reduction == "mean" else scale
        return scales[key]

    # gate and up scale their one input once; the copy goes after the input's last reader
    readers = Counter(input_key(inputs[0]) for _, inputs, _ in kept if inputs)
    with shared_scaled_inputs() as shared:
        for module, inputs, grad_out in kept:
            if inputs is None:  # per-sample gradients materialised in the first pass
                first = next(iter(grad_out.values()))
                for name, g in clipped_sum(grad_out, scale_for(first)).items():
                    _add(out, module, name, g)
                continue
            room = room_for(module, type_of(module))
            scale = scale_for(grad_out)
            grads = room.clipped_grad_folded(module, inputs, grad_out, scale, fused_kernels)
            if grads is None:
                if not room.direct and any(
                    isinstance(p, torch.distributed.tensor.DTensor)
                    for p in module.parameters(recurse=False)
                ):
                    raise OneBackwardUnavailable(
                        f"{type(module).__name__} has no direct clipped-gradient formula and its "
                        "parameters are sharded here"
                    )
                # the room scales the narrowest operand it can, never more than the output gradient
                if room.sums_sequence_shards:
                    group = sequence_group(module)
                    grads = room.clipped_grad(module, inputs, grad_out, scale, sequence_group=group)
                else:
                    grads = room.clipped_grad(module, inputs, grad_out, scale)
            for name, g in grads.items():
                p = getattr(module, name, None)
                if p is not None and p.requires_grad:
                    _add(out, module, name, g)
            if inputs:
                key = input_key(inputs[0])
                readers[key] -= 1
                if not readers[key]:
                    shared.release(key)
    return out


def _add(out: dict, module: nn.Module, name: str, g: torch.Tensor) -> None:
    """Adds one call's clipped gradient to ``out``.

    A layer called several times in a forward (Opacus's ``RNNLinear`` cells, once per time step)
    keeps one entry per call, and its clipped gradient is their sum (the coefficients are per
    sample, the sum over calls is linear).
    """
    key = (id(module), name)
    if key in out:
        g = out[key][2] + g
    out[key] = (module, name, g)


def by_parameter(grads: dict) -> dict[int, tuple[nn.Parameter, torch.Tensor]]:
    """Sums the gradients of each parameter over its uses (tied weights): ``{id: (p, grad)}``."""
    tied = room_named("tied")
    total: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    for module, name, g in grads.values():
        p = getattr(module, name)
        if id(p) in total:
            total[id(p)] = (p, tied.clipped_grad([total[id(p)][1], g]))
        else:
            total[id(p)] = (p, g)
    return total


def hand_to_single_device(grads: dict) -> None:
    """Sets ``p.grad`` (adding to what is there, as autograd would).

    A tensor-parallel parameter (TP alone) takes its shard as a DTensor of its placements.
    """
    from ..distributed.tensor_parallel import as_param_grad

    for p, g in by_parameter(grads).values():
        g = as_param_grad(p, g.to(p.dtype))
        p.grad = g if p.grad is None else p.grad + g


def unsupported_layers(hooked: list[nn.Module], type_of, *, generic_replay: bool) -> list[str]:
    """Names of hooked layer types with no direct formula where the generic path cannot run.

    Args:
        hooked: The layers Opacus hooks.
        type_of: Maps a module to the layer type Opacus sees.
        generic_replay: Whether the API can replay a layer generically (it needs full parameter
            values: one device and DDP can, the sharded APIs cannot).
    """
    if generic_replay:
        return []
    return sorted({type_of(m).__name__ for m in hooked if not room_for(m, type_of(m)).direct})
