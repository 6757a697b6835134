"""Clipped weight gradients of one layer, from its kept inputs and output gradient.

With ``b`` the layer's output gradient from the activations-only first pass (scaled so that row n
is the gradient of sample n's loss) and ``c`` the clipping coefficients, the clipped gradient
``sum_n c_n grad_n`` is the layer's weight gradient for the output gradient ``c_n b_n``: one
matmul for ``Linear``, ``embedding_dense_backward`` for ``Embedding``, a reduction for the norm
layers (RMSNorm-like layers only where :mod:`..rms_norm` verified its formula against autograd),
and, for any other layer, the layer's own autograd on its stored inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import replay, rms_norm


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _linear(layer: nn.Linear, inputs, grad_out) -> dict[str, torch.Tensor]:
    a = _flat(inputs[0]).to(grad_out.dtype)
    g = _flat(grad_out)
    out = {"weight": g.t() @ a}
    if layer.bias is not None:
        out["bias"] = g.sum(0)
    return out


def _embedding(layer: nn.Embedding, inputs, grad_out) -> dict[str, torch.Tensor]:
    ids = inputs[0]
    pad = -1 if layer.padding_idx is None else layer.padding_idx
    grad = torch.ops.aten.embedding_dense_backward(
        grad_out, ids, layer.num_embeddings, pad, layer.scale_grad_by_freq
    )
    return {"weight": grad}


def _layer_norm(layer: nn.LayerNorm, inputs, grad_out) -> dict[str, torch.Tensor]:
    x = inputs[0]
    xhat = F.layer_norm(x, layer.normalized_shape, None, None, layer.eps)
    dims = tuple(range(grad_out.dim() - len(layer.normalized_shape)))
    out = {}
    if layer.weight is not None:
        out["weight"] = (grad_out * xhat).sum(dims)
    if layer.bias is not None:
        out["bias"] = grad_out.sum(dims)
    return out


def _rms_norm(layer: nn.Module, inputs, grad_out) -> dict[str, torch.Tensor]:
    x = inputs[0]
    xhat = rms_norm.normalized(x, rms_norm.epsilon(layer))
    return {"weight": (grad_out.to(xhat.dtype) * xhat).reshape(-1, x.shape[-1]).sum(0)}


def direct_formula(module: nn.Module, module_type: type):
    """The direct formula for a layer type, or None (then the generic path is needed)."""
    if issubclass(module_type, nn.Linear):
        return _linear
    if issubclass(module_type, nn.Embedding):
        return _embedding
    if issubclass(module_type, nn.LayerNorm):
        return _layer_norm
    if rms_norm.has_rms_formula(module, module_type):  # checked against autograd per type
        return _rms_norm
    return None


def generic(module: nn.Module, inputs, grad_out, params: dict[str, torch.Tensor]):
    """Any layer: replay its recorded forward on the stored inputs, differentiate w.r.t. ``params``.

    The replay (:func:`..replay.replay`) runs with the call's keyword arguments and RNG state
    (the same dropout mask) and leaves the layer's buffers and the caller's RNG as they were.
    ``params`` maps names to the tensors registered now; they must hold their full values.
    """
    names = list(params)
    out = replay.replay(module, inputs, getattr(inputs, "call", None))
    with torch.enable_grad():
        grads = torch.autograd.grad(out, [params[n] for n in names], grad_out, allow_unused=True)
    return {n: g for n, g in zip(names, grads) if g is not None}
