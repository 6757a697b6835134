"""Triton kernels for two memory-bound steps of the private step: row scaling and batched dots.

Imported only where Triton imports (:mod:`.rows` decides). Both read contiguous ``(N, K)``
views (the caller checks), in programs of ``BLOCK`` elements along a row and one row (sample)
per grid column, with int64 offsets.

- :func:`scale_rows`: ``out[n] = t[n] * scale[n]``, the product formed in fp32 and rounded once
  to the output dtype (round to nearest even), bit for bit what ``torch.mul(t, scale.view(N, 1,
  ...), out=out)`` computes. torch runs that broadcast, dtype-casting multiply as a
  non-vectorised elementwise kernel on CUDA.
- :func:`batched_dot`: ``sum_k a[n, k] * b[n, k]`` of fp32 rows, in fp32: each program sums
  ``BLOCK x ITERS`` products into a partial and the partials are summed by ``torch.sum``, so the
  result does not depend on scheduling (no atomics). It replaces a batched ``1 x K`` by ``K x 1``
  matmul that cuBLAS runs as a matrix-vector kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_linear import _to

#: Elements per program along a row (CUDA / the CPU interpreter) and per step of a dot's loop.
SCALE_BLOCK_CUDA = 4096
DOT_BLOCK_CUDA = 2048
#: Steps of the dot's loop per program on CUDA: a program sums ``DOT_BLOCK_CUDA x DOT_ITERS``.
DOT_ITERS_CUDA = 8
INTERPRETER_BLOCK = 64


@triton.jit
def _scale_rows_kernel(
    t_ptr, scale_ptr, out_ptr, row_len, BLOCK: tl.constexpr, UPCAST: tl.constexpr
):
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_len
    x = tl.load(t_ptr + row * row_len + offs, mask=mask).to(tl.float32)
    y = x * tl.load(scale_ptr + row)
    tl.store(out_ptr + row * row_len + offs, _to(y, out_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def _dot_partials_kernel(
    a_ptr, b_ptr, partial_ptr, row_len, chunks, BLOCK: tl.constexpr, ITERS: tl.constexpr
):
    row = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_len
        x = tl.load(a_ptr + row * row_len + offs, mask=mask, other=0.0)
        y = tl.load(b_ptr + row * row_len + offs, mask=mask, other=0.0)
        acc += x * y
    tl.store(partial_ptr + row * chunks + chunk, tl.sum(acc, axis=0))


def scale_rows(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (contiguous, ``N`` rows) times ``scale[n]`` per row (fp32 ``(N,)``), in ``dtype``."""
    n = t.shape[0]
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    row_len = t.numel() // n if n else 0
    if row_len == 0:
        return out
    on_cuda = t.device.type == "cuda"
    block = SCALE_BLOCK_CUDA if on_cuda else INTERPRETER_BLOCK
    _scale_rows_kernel[(triton.cdiv(row_len, block), n)](
        t, scale, out, row_len, BLOCK=block, UPCAST=not on_cuda, num_warps=8 if on_cuda else 1
    )
    return out


def batched_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N,)`` fp32: the dot product of each row pair of contiguous fp32 ``a`` and ``b``."""
    n = a.shape[0]
    row_len = a.numel() // n if n else 0
    if row_len == 0:
        return torch.zeros(n, dtype=a.dtype, device=a.device)
    on_cuda = a.device.type == "cuda"
    block, iters = (DOT_BLOCK_CUDA, DOT_ITERS_CUDA) if on_cuda else (INTERPRETER_BLOCK, 2)
    chunks = triton.cdiv(row_len, block * iters)
    partial = torch.empty(n, chunks, dtype=torch.float32, device=a.device)
    _dot_partials_kernel[(chunks, n)](
        a, b, partial, row_len, chunks, BLOCK=block, ITERS=iters, num_warps=8 if on_cuda else 1
    )
    return partial.sum(1)
