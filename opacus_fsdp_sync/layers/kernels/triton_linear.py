"""Triton kernels of the ``Linear`` room: ghost norm, per-sample-gradient norm, clipped gradient.

Imported only where Triton is importable (:mod:`.availability`); the custom ops in
:mod:`.ops` call the launchers below. Every kernel reads the layer input ``A`` (``N x T x
d_in``) and output gradient ``G`` (``N x T x d_out``) through their strides (no copies),
accumulates in fp32 registers and masks the edges, so ``T`` and the widths need not be tile
multiples. Offsets are formed in int64 (a vocabulary-wide head's gradient has more than
``2^31`` elements). Each norm kernel writes one fp32 partial per program and the launcher sums
them, so the result does not depend on scheduling (no atomics).

fp32 operands take ``tl.dot``'s ``"ieee"`` precision unless ``torch.backends.cuda.matmul
.allow_tf32`` is set, as PyTorch's own fp32 matmuls do; bf16 and fp16 operands are multiplied
exactly into fp32 accumulators.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tiles:
    """Tile sizes (powers of two, at least 16, as ``tl.arange`` and ``tl.dot`` need) and warps.

    Attributes:
        ghost_features: Features per step of the ghost norm's tile products (its token tile is
            the op's ``block_t``).
        ghost_warps: ``num_warps`` of the ghost norm.
        gemm_out: Side of the square ``(d_out, d_in)`` output tile of the two GEMM kernels.
        gemm_rows: Tokens (or flattened ``N T`` rows) per step of their reduction.
        gemm_warps: Their ``num_warps``.
    """

    ghost_features: int
    ghost_warps: int
    gemm_out: int
    gemm_rows: int
    gemm_warps: int


#: CUDA: usual first choices for such kernels (the GEMMs as Triton's matmul tutorial), not
#: tuned on a GPU yet.
CUDA_TILES = Tiles(ghost_features=32, ghost_warps=4, gemm_out=128, gemm_rows=32, gemm_warps=8)
#: The interpreter (``TRITON_INTERPRET=1``, CPU): the smallest tiles keep it fast.
INTERPRETER_TILES = Tiles(ghost_features=16, ghost_warps=1, gemm_out=16, gemm_rows=16, gemm_warps=1)


def tiles_for(device: torch.device) -> Tiles:
    """The tiles used on ``device``."""
    return CUDA_TILES if device.type == "cuda" else INTERPRETER_TILES


def _upcast(*tensors: torch.Tensor) -> bool:
    """Whether to work around Triton 3.9's interpreter: fp32 operands there.

    Its ``tl.dot`` multiplies bf16 operands wrongly and its fp32-to-bf16 cast truncates.
    """
    return any(t.device.type != "cuda" and t.dtype != torch.float32 for t in tensors)


def _precision(*tensors: torch.Tensor) -> str:
    """``tl.dot``'s precision: IEEE for fp32 operands unless TF32 is allowed, as in PyTorch.

    Without fp32 operands the option is ignored; ``"tf32"`` (the default) is passed then.
    """
    if not any(t.dtype == torch.float32 for t in tensors):
        return "tf32"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@triton.jit
def _dot(x, y, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + x @ y``; with ``UPCAST`` on fp32 copies (exact for bf16 and fp16 operands)."""
    if UPCAST:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    return tl.dot(x, y, acc, input_precision=PRECISION)


@triton.jit
def _to(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``x`` in ``dtype``, rounded to nearest even (the interpreter's bf16 cast truncates)."""
    if UPCAST:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    return x.to(dtype)


@triton.jit
def _ghost_norm_kernel(
    a_ptr, g_ptr, pairs_ptr, out_ptr,
    T, D_IN, D_OUT, P,
    sa_n, sa_t, sa_d, sg_n, sg_t, sg_d,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One tile pair ``(i, j)``, ``i <= j``, of one sample: ``sum(A_i A_j^T * G_i G_j^T)``."""
    p = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    i = tl.load(pairs_ptr + 2 * p).to(tl.int64)
    j = tl.load(pairs_ptr + 2 * p + 1).to(tl.int64)
    rows = i * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = j * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    row_ok = rows < T
    col_ok = cols < T
    offs = tl.arange(0, BLOCK_D).to(tl.int64)

    a_base = a_ptr + n * sa_n
    aa = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for d0 in range(0, D_IN, BLOCK_D):
        d = d0 + offs
        d_ok = d < D_IN
        x = tl.load(
            a_base + rows[:, None] * sa_t + d[None, :] * sa_d,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        y = tl.load(
            a_base + d[:, None] * sa_d + cols[None, :] * sa_t,
            mask=d_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        aa = _dot(x, y, aa, PRECISION, UPCAST)

    g_base = g_ptr + n * sg_n
    gg = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for d0 in range(0, D_OUT, BLOCK_D):
        d = d0 + offs
        d_ok = d < D_OUT
        x = tl.load(
            g_base + rows[:, None] * sg_t + d[None, :] * sg_d,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        y = tl.load(
            g_base + d[:, None] * sg_d + cols[None, :] * sg_t,
            mask=d_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        gg = _dot(x, y, gg, PRECISION, UPCAST)

    total = tl.sum(tl.sum(aa * gg, axis=1), axis=0)
    total = tl.where(i == j, total, 2.0 * total)  # an off-diagonal tile stands for its mirror
    tl.store(out_ptr + n * P + p, total)


@triton.jit
def _per_sample_norm_kernel(
    a_ptr, g_ptr, out_ptr,
    T, D_IN, D_OUT, TILES_IN, TILES,
    sa_n, sa_t, sa_d, sg_n, sg_t, sg_d,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One ``(d_out, d_in)`` tile of ``G_n^T A_n``, reduced to its squared Frobenius norm."""
    tile = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    o = (tile // TILES_IN) * BLOCK_O + tl.arange(0, BLOCK_O).to(tl.int64)
    c = (tile % TILES_IN) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    o_ok = o < D_OUT
    c_ok = c < D_IN
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    a_base = a_ptr + n * sa_n
    g_base = g_ptr + n * sg_n
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs
        t_ok = t < T
        gt = tl.load(
            g_base + o[:, None] * sg_d + t[None, :] * sg_t,
            mask=o_ok[:, None] & t_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            a_base + t[:, None] * sa_t + c[None, :] * sa_d,
            mask=t_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        acc = _dot(gt, x.to(gt.dtype), acc, PRECISION, UPCAST)
    total = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
    tl.store(out_ptr + n * TILES + tile, total)


@triton.jit
def _clipped_grad_kernel(
    a_ptr, g_ptr, c_ptr, out_ptr,
    T, ROWS, D_IN, D_OUT,
    sa_n, sa_t, sa_d, sg_n, sg_t, sg_d, so_o, so_i,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One ``(d_out, d_in)`` tile of ``sum_n c_n G_n^T A_n`` over the ``N T`` rows."""
    o = tl.program_id(0).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    o_ok = o < D_OUT
    c_ok = c < D_IN
    offs = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for k0 in range(0, ROWS, BLOCK_K):
        k = k0 + offs
        k_ok = k < ROWS
        n = k // T
        t = k % T
        coef = tl.load(c_ptr + n, mask=k_ok, other=0.0)
        gt = tl.load(
            g_ptr + o[:, None] * sg_d + n[None, :] * sg_n + t[None, :] * sg_t,
            mask=o_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        # The scaled gradient is rounded to its dtype, as the torch path's one multiply does.
        gt = _to(gt.to(tl.float32) * coef[None, :], gt.dtype, UPCAST)
        x = tl.load(
            a_ptr + n[:, None] * sa_n + t[:, None] * sa_t + c[None, :] * sa_d,
            mask=k_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        acc = _dot(gt, x.to(gt.dtype), acc, PRECISION, UPCAST)
    tl.store(
        out_ptr + o[:, None] * so_o + c[None, :] * so_i,
        _to(acc, out_ptr.dtype.element_ty, UPCAST),
        mask=o_ok[:, None] & c_ok[None, :],
    )


_PAIRS: dict[tuple[int, str], torch.Tensor] = {}


def _tile_pairs(blocks: int, device: torch.device) -> torch.Tensor:
    """``(P, 2)`` int32 ``(i, j)``, ``i <= j``: the upper triangle of ``blocks`` token tiles."""
    key = (blocks, str(device))
    pairs = _PAIRS.get(key)
    if pairs is None:
        pairs = torch.triu_indices(blocks, blocks, device=device).t().to(torch.int32).contiguous()
        _PAIRS[key] = pairs
    return pairs


def ghost_norm(a: torch.Tensor, g: torch.Tensor, block_t: int) -> torch.Tensor:
    """Per-sample ``<A_n A_n^T, G_n G_n^T>``, ``(N,)`` fp32: :func:`.ops.ghost_norm_linear`."""
    n, t, d_in = a.shape
    d_out = g.shape[-1]
    tiles = tiles_for(a.device)
    blocks = triton.cdiv(t, block_t)
    pairs = _tile_pairs(blocks, a.device)
    partial = torch.empty(n, pairs.shape[0], device=a.device, dtype=torch.float32)
    _ghost_norm_kernel[(pairs.shape[0], n)](
        a, g, pairs, partial,
        t, d_in, d_out, pairs.shape[0],
        *a.stride(), *g.stride(),
        BLOCK_T=block_t, BLOCK_D=tiles.ghost_features, PRECISION=_precision(a, g),
        UPCAST=_upcast(a, g), num_warps=tiles.ghost_warps,
    )  # fmt: skip
    return partial.sum(1)


def per_sample_norm(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample ``|G_n^T A_n|_F^2`` in fp32, ``(N,)``; see :func:`.ops.per_sample_norm_linear`."""
    n, t, d_in = a.shape
    d_out = g.shape[-1]
    tiles = tiles_for(a.device)
    tiles_in = triton.cdiv(d_in, tiles.gemm_out)
    count = triton.cdiv(d_out, tiles.gemm_out) * tiles_in
    partial = torch.empty(n, count, device=a.device, dtype=torch.float32)
    _per_sample_norm_kernel[(count, n)](
        a, g, partial,
        t, d_in, d_out, tiles_in, count,
        *a.stride(), *g.stride(),
        BLOCK_O=tiles.gemm_out, BLOCK_I=tiles.gemm_out, BLOCK_T=tiles.gemm_rows,
        PRECISION=_precision(a, g), UPCAST=_upcast(a, g), num_warps=tiles.gemm_warps,
    )  # fmt: skip
    return partial.sum(1)


def clipped_grad(a: torch.Tensor, g: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``sum_n c_n G_n^T A_n`` in ``g``'s dtype; see :func:`.ops.clipped_grad_linear`."""
    n, t, d_in = a.shape
    d_out = g.shape[-1]
    tiles = tiles_for(a.device)
    out = torch.empty(d_out, d_in, device=g.device, dtype=g.dtype)
    grid = (triton.cdiv(d_out, tiles.gemm_out), triton.cdiv(d_in, tiles.gemm_out))
    _clipped_grad_kernel[grid](
        a, g, coef, out,
        t, n * t, d_in, d_out,
        *a.stride(), *g.stride(), *out.stride(),
        BLOCK_O=tiles.gemm_out, BLOCK_I=tiles.gemm_out, BLOCK_K=tiles.gemm_rows,
        PRECISION=_precision(a, g), UPCAST=_upcast(a, g), num_warps=tiles.gemm_warps,
    )  # fmt: skip
    return out
