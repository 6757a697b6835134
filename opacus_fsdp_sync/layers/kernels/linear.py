"""What the ``Linear`` room asks of the fused kernels: squared norms and clipped gradients.

Both functions return None where the kernels do not apply (:func:`.availability.use_fused`),
and the room then takes its torch path. They work on local tensors: a DTensor (tensor
parallelism) is taken as its ``to_local()`` shard, as the torch path does.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..linear_grams import widen
from .availability import use_fused
from .ops import (
    clipped_grad_linear,
    gemm_flops,
    ghost_norm_flops,
    ghost_norm_linear,
    per_sample_norm_linear,
)

logger = logging.getLogger(__name__)

#: Tokens per tile of the ghost-norm kernel: on CUDA, and under the CPU interpreter.
GHOST_BLOCK_CUDA = 64
GHOST_BLOCK_INTERPRETER = 16


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t) is torch.Tensor:  # the common case, without the import and the subclass check
        return t
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _as_3d(t: torch.Tensor, n: int, tokens: int) -> torch.Tensor:
    return t.reshape(n, tokens, t.shape[-1])


def ghost_block(device: torch.device) -> int:
    """Tokens per tile of the ghost-norm kernel on ``device``."""
    return GHOST_BLOCK_CUDA if device.type == "cuda" else GHOST_BLOCK_INTERPRETER


def weight_sq_norm(a: torch.Tensor, g: torch.Tensor, block_t: int | None = None) -> torch.Tensor:
    """Per-sample squared weight-gradient norms ``(N,)`` in fp32, by the cheaper kernel.

    The ghost norm costs ``2 w_i w_j (d_in + d_out)`` FLOPs per tile pair (about ``T^2 (d_in
    + d_out)`` per sample), the per-sample-gradient epilogue ``2 T d_in d_out``: the latter wins
    on long sequences (an MLP projection of 2048 x 8192 from ``T = 3224`` with 64-token
    tiles). Ties go to the ghost norm.

    Args:
        a: Layer input ``(N, T, d_in)``.
        g: Output gradient ``(N, T, d_out)``.
        block_t: Ghost-norm tile (None: :func:`ghost_block` of the device).
    """
    n, t, d_in = a.shape
    d_out = g.shape[-1]
    block_t = ghost_block(a.device) if block_t is None else block_t
    if gemm_flops(n, t, d_in, d_out) < ghost_norm_flops(n, t, d_in, d_out, block_t):
        return per_sample_norm_linear(a, g)
    return ghost_norm_linear(a, g, block_t)


def linear_sq_norms(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, option: bool | None
) -> dict[str, torch.Tensor] | None:
    """Squared per-sample norms ``{"weight": (N,), "bias": (N,)}`` of the trainable parameters.

    The weight's from a kernel (:func:`weight_sq_norm`); the bias's ``|sum_t g_t|^2`` in torch
    (it reads ``g`` once).

    Args:
        layer: The layer.
        a: Its input ``(N, T, d_in)``.
        g: Its output gradient ``(N, T, d_out)``, scaled per sample as Opacus hands it over.
        option: :attr:`~opacus_fsdp_sync.options.GhostOptions.fused_kernels`.

    Returns:
        None where the kernels do not apply here (the torch path runs).
    """
    if option is not True:  # use_fused's first test, before any conversion
        return None
    a, g = _local(a), _local(g)
    if a.dim() != 3 or g.dim() != 3 or not use_fused(option, a, g):
        return None
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = weight_sq_norm(a, g)
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = widen(g).sum(1).pow(2).sum(1)
    return out


def linear_clipped_grad(
    layer: nn.Linear,
    inputs: list[torch.Tensor],
    grad_out: torch.Tensor,
    coef: torch.Tensor,
    option: bool | None,
) -> dict[str, torch.Tensor] | None:
    """``{"weight": sum_n c_n G_n^T A_n, "bias": sum_n c_n sum_t g_t}`` in ``grad_out``'s dtype.

    Args:
        layer: The layer.
        inputs: Its captured inputs (the first is ``A``, batch first, any rank).
        grad_out: Its output gradient (batch first), not yet scaled.
        coef: The coefficients ``c`` (``(N,)``, fp32): clipping factors, times the batch size
            for a mean loss.
        option: :attr:`~opacus_fsdp_sync.options.GhostOptions.fused_kernels`.

    Returns:
        None where the kernels do not apply here (the torch path runs).
    """
    a, g = _local(inputs[0]), _local(grad_out)
    if not use_fused(option, a, g):
        return None
    n = a.shape[0]
    tokens = math.prod(a.shape[1:-1])
    a, g = _as_3d(a, n, tokens), _as_3d(g, n, tokens)
    coef = coef.to(device=g.device, dtype=torch.float32)
    out = {"weight": clipped_grad_linear(a, g, coef)}
    if layer.bias is not None:
        out["bias"] = (widen(g).sum(1) * coef.view(-1, 1)).sum(0).to(g.dtype)
    return out
