"""Bytes that one backward keeps from its first pass: estimated before it, measured after it.

One backward keeps, from the first pass to the gradient phase, each hooked layer's inputs and
output gradient, or, for a sequence ``Linear`` layer that takes them, its per-sample gradients
(:mod:`opacus_fsdp_sync.one_backward`). Both are known from the forward alone: the inputs are
what Opacus captured, the output gradient has the output's shape and dtype, and per-sample
gradients are ``N x d_out x d_in`` (plus ``N x d_out`` for a bias) in that dtype. A tensor read
by several layers (``q``/``k``/``v``'s input) is counted once, by its memory (:func:`memory_key`),
in the estimate and in the measurement alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from .._opacus_internals import captured_activations
from .contract import Kept, KeptLayer


def memory_key(t: torch.Tensor) -> tuple:
    """Identifies a tensor's memory: equal for two views of the same elements."""
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def kept_bytes(kept: Kept) -> int:
    """Bytes of what a first pass kept (each tensor's memory once)."""
    held: dict[tuple, int] = {}
    for _, inputs, grad in kept:
        for t in list(grad.values()) if inputs is None else [*inputs, grad]:
            if isinstance(t, torch.Tensor):
                held[memory_key(t)] = nbytes(t)
    return sum(held.values())


def output_meta(forward_output) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype of a layer's first output tensor (its kept output gradient's)."""
    if isinstance(forward_output, (list, tuple)):
        forward_output = next((t for t in forward_output if isinstance(t, torch.Tensor)), None)
    if not isinstance(forward_output, torch.Tensor):
        return None
    return tuple(forward_output.shape), forward_output.dtype


def linear_per_sample_bytes(
    layer: nn.Linear, inputs: list[torch.Tensor], meta: tuple[tuple[int, ...], torch.dtype]
) -> int | None:
    """Bytes of a sequence ``Linear`` layer's per-sample gradients, or None where not taken.

    The per-sample path takes plain ``(N, T, d_in)`` inputs only (see
    :func:`~opacus_fsdp_sync.layers.linear_norms.make_linear_norm_sampler`).
    """
    if len(inputs) != 1 or type(inputs[0]) is not torch.Tensor or inputs[0].dim() != 3:
        return None
    shape, dtype = meta
    n, d_in, d_out = shape[0], inputs[0].shape[-1], shape[-1]
    values = d_in * d_out if layer.weight.requires_grad else 0
    if layer.bias is not None and layer.bias.requires_grad:
        values += d_out
    return n * values * dtype.itemsize


def estimate(
    captured: Iterable[nn.Module],
    outputs: dict[int, tuple[tuple[int, ...], torch.dtype]],
    per_sample: Callable[[nn.Module, list[torch.Tensor], tuple], int | None],
) -> list[KeptLayer]:
    """What each captured layer would keep in a one-backward first pass.

    Args:
        captured: The layers captured in this forward (their last ``activations`` entry is what
            they would keep).
        outputs: Each layer's output shape and dtype (:func:`output_meta`), by ``id``.
        per_sample: A layer's per-sample gradient bytes where it could keep those, else None.
    """
    out = []
    for module in captured:
        acts = captured_activations(module)
        meta = outputs.get(id(module))
        if not acts or meta is None:
            continue
        inputs = [t for t in acts[-1] if isinstance(t, torch.Tensor)]
        grad = torch.Size(meta[0]).numel() * meta[1].itemsize
        out.append(
            KeptLayer(
                layer=id(module),
                inputs=tuple((memory_key(t), nbytes(t)) for t in inputs),
                grad_out=grad,
                per_sample=per_sample(module, inputs, meta),
            )
        )
    return out
