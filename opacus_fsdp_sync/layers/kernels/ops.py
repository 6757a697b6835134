"""The ``Linear`` kernels as ``torch.library`` custom ops, with fake impls and FLOP formulas.

Three ops in the ``opacus_fsdp_sync`` namespace, each on a layer input ``a`` (``N x T x
d_in``) and output gradient ``g`` (``N x T x d_out``):

- ``ghost_norm_linear(a, g, block_t)``: per-sample ``sum_{t,s} (a_t . a_s)(g_t . g_s)``, the
  squared weight-gradient norm, over the upper triangle of ``block_t``-token tiles;
- ``per_sample_norm_linear(a, g)``: per-sample ``|G_n^T A_n|_F^2`` as a GEMM epilogue (the
  per-sample gradient is never written);
- ``clipped_grad_linear(a, g, coef)``: ``sum_n c_n G_n^T A_n``, the coefficients applied to
  the output-gradient tiles as they are loaded.

Each runs its Triton kernel (:mod:`.triton_linear`) where one can launch (CUDA, or CPU under
``TRITON_INTERPRET=1``) and the torch path otherwise (fp64, no Triton): the same functions the
``Linear`` room uses without kernels (:mod:`..linear_grams`), which are also the tests'
reference. An empty batch returns an empty (or zero) result without a launch.

FLOPs count as PyTorch's counter counts matmuls (``2 m n k`` per matmul-equivalent, elementwise
work free), so :class:`~opacus_fsdp_sync.profiling.PhaseFlopCounter` and
``torch.utils.flop_counter.FlopCounterMode`` price an op as the torch path doing the same work:
the ghost norm as the two Gram products of its tile pairs (the block-triangle torch path with
the same ``block_t``), the other two as one batched GEMM each.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..linear_grams import contract_output_grams, row_blocks, upper_gram, widen
from .availability import DTYPES, can_launch

logger = logging.getLogger(__name__)


def _norm_dtype(a: Tensor, g: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)


#: CUDA's limit on a grid's second dimension, which the norm kernels give the samples.
MAX_SAMPLES = 65535


def _triton(a: Tensor, g: Tensor) -> bool:
    supported = a.dtype in DTYPES and g.dtype in DTYPES and a.shape[0] <= MAX_SAMPLES
    return supported and can_launch(a, g)


def _check(a: Tensor, g: Tensor) -> None:
    torch._check(a.dim() == 3 and g.dim() == 3, lambda: "a and g must be (N, T, d)")
    torch._check(a.shape[:2] == g.shape[:2], lambda: f"a {a.shape} and g {g.shape}: N, T differ")


def ghost_norm_reference(a: Tensor, g: Tensor, block_t: int) -> Tensor:
    """The torch path's squared ghost norm in row blocks of ``block_t`` tokens (the oracle)."""
    w_sq, _ = contract_output_grams(upper_gram(a, block_t), g, block_t, bias=False)
    return w_sq


def per_sample_norm_reference(a: Tensor, g: Tensor) -> Tensor:
    """The torch path's squared per-sample-gradient norm: materialised, then reduced."""
    psg = torch.bmm(g.transpose(1, 2), a.to(g.dtype))
    return widen(psg).pow(2).sum((1, 2))


def clipped_grad_reference(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """The torch path's clipped gradient: scale ``g`` (rounded once), then one matmul."""
    scale = coef.to(device=g.device, dtype=torch.float32).view(-1, 1, 1)
    scaled = torch.mul(g, scale, out=torch.empty_like(g))
    return scaled.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1]).to(g.dtype)


@torch.library.custom_op("opacus_fsdp_sync::ghost_norm_linear", mutates_args=())
def ghost_norm_linear(a: Tensor, g: Tensor, block_t: int) -> Tensor:
    """Per-sample squared weight-gradient norm of a ``Linear`` layer, ``(N,)`` in fp32.

    ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` over the upper triangle of ``block_t``-token tiles
    (diagonal tiles once, the others twice), in fp32 registers: no ``T x T`` tensor is stored.

    Args:
        a: Layer input ``(N, T, d_in)``.
        g: Output gradient ``(N, T, d_out)``.
        block_t: Tokens per tile: a power of two, at least 16, for the kernel (another
            value takes the torch path in row blocks of that many tokens).
    """
    _check(a, g)
    if a.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros(a.shape[0], device=a.device, dtype=_norm_dtype(a, g))
    if _triton(a, g) and block_t >= 16 and block_t & (block_t - 1) == 0:
        from . import triton_linear

        return triton_linear.ghost_norm(a, g, block_t)
    return ghost_norm_reference(a, g, block_t).to(_norm_dtype(a, g))


@ghost_norm_linear.register_fake
def _(a: Tensor, g: Tensor, block_t: int) -> Tensor:
    return a.new_empty(a.shape[0], dtype=_norm_dtype(a, g))


@torch.library.custom_op("opacus_fsdp_sync::per_sample_norm_linear", mutates_args=())
def per_sample_norm_linear(a: Tensor, g: Tensor) -> Tensor:
    """Per-sample ``|G_n^T A_n|_F^2``, ``(N,)`` in fp32, without writing ``G_n^T A_n``.

    Each ``(d_out, d_in)`` tile of the per-sample gradient is accumulated over the tokens in
    fp32 and reduced to its sum of squares in the epilogue.

    Args:
        a: Layer input ``(N, T, d_in)``.
        g: Output gradient ``(N, T, d_out)``.
    """
    _check(a, g)
    if a.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros(a.shape[0], device=a.device, dtype=_norm_dtype(a, g))
    if _triton(a, g):
        from . import triton_linear

        return triton_linear.per_sample_norm(a, g)
    return per_sample_norm_reference(a, g).to(_norm_dtype(a, g))


@per_sample_norm_linear.register_fake
def _(a: Tensor, g: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], dtype=_norm_dtype(a, g))


@torch.library.custom_op("opacus_fsdp_sync::clipped_grad_linear", mutates_args=())
def clipped_grad_linear(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """A ``Linear`` layer's clipped weight gradient ``sum_n c_n G_n^T A_n``, in ``g``'s dtype.

    ``c_n g`` is formed in fp32 as each tile is loaded and rounded to ``g``'s dtype (as the
    torch path's scaled output gradient is), then accumulated in fp32 over all ``N T`` rows;
    the scaled output gradient is never stored.

    Args:
        a: Layer input ``(N, T, d_in)``.
        g: Output gradient ``(N, T, d_out)``.
        coef: Per-sample coefficients ``(N,)``, fp32.
    """
    _check(a, g)
    torch._check(coef.shape == (a.shape[0],), lambda: f"coef {coef.shape}: one per sample")
    if a.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros(g.shape[-1], a.shape[-1], device=g.device, dtype=g.dtype)
    if _triton(a, g):
        from . import triton_linear

        coef = coef.to(device=g.device, dtype=torch.float32).contiguous()
        return triton_linear.clipped_grad(a, g, coef)
    return clipped_grad_reference(a, g, coef)


@clipped_grad_linear.register_fake
def _(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    return g.new_empty(g.shape[-1], a.shape[-1])


def ghost_norm_flops(n: int, t: int, d_in: int, d_out: int, block_t: int) -> int:
    """FLOPs of :func:`ghost_norm_linear`: ``2 w_i w_j (d_in + d_out + 1)`` per tiles i <= j.

    The two Gram tiles (``d_in + d_out``, as the block-triangle torch path's Gram matmuls with
    ``gram_block = block_t``, and the full Grams' ``2 N T^2 (d_in + d_out)`` when one tile
    covers ``T``), then their contraction (one multiply-add per tile element, which the torch
    path runs as batched dots).
    """
    widths = [w for _, w in row_blocks(t, block_t)]
    pairs = (sum(widths) ** 2 + sum(w * w for w in widths)) // 2  # sum over i <= j of w_i w_j
    return 2 * n * pairs * (d_in + d_out + 1)


def gemm_flops(n: int, t: int, d_in: int, d_out: int) -> int:
    """FLOPs of the per-sample-gradient norm and of the clipped gradient: ``2 N T d_in d_out``."""
    return 2 * n * t * d_in * d_out


@register_flop_formula(torch.ops.opacus_fsdp_sync.ghost_norm_linear)
def _ghost_norm_flop(a_shape, g_shape, block_t, *args, out_shape=None, **kwargs) -> int:
    n, t, d_in = a_shape
    return ghost_norm_flops(n, t, d_in, g_shape[-1], block_t)


_GEMM_OPS = [
    torch.ops.opacus_fsdp_sync.per_sample_norm_linear,
    torch.ops.opacus_fsdp_sync.clipped_grad_linear,
]


@register_flop_formula(_GEMM_OPS)
def _gemm_flop(a_shape, g_shape, *args, out_shape=None, **kwargs) -> int:
    n, t, d_in = a_shape
    return gemm_flops(n, t, d_in, g_shape[-1])
