"""Ghost-norm contractions from the upper block triangle of symmetric per-sample Gram matrices.

A sequence ``Linear`` layer's per-sample weight-gradient norm is ``<A A^T, G G^T>`` (``T x T``
Gram matrices of its input and output gradient). Both Grams are symmetric, so the contraction
needs only their upper block triangle: split the ``T`` positions into row blocks of ``b``
tokens; row block ``i`` (rows ``s_i .. s_i + w_i``) is multiplied against columns ``s_i .. T``
only, and

    <A A^T, G G^T> = sum_i ( <diagonal block_i> + 2 <off-diagonal part of row block_i> ).

When ``b`` divides ``T`` into ``k`` blocks this computes ``(k + 1) / (2 k)`` of the full Grams'
matmul FLOPs: 3/4 at two blocks, 5/8 at four, 9/16 at eight (:func:`flop_fraction` in general).
It never holds a full ``N x T x T`` Gram of an output gradient: each row block is contracted and
dropped. The result equals the full contraction to floating-point rounding (the summation order
differs).

Precision and traffic: every Gram piece is held in fp32 (fp64 for fp64 inputs). On CUDA the
matmul writes fp32 itself from fp16/bf16 inputs (``out_dtype``, accumulated in fp32); elsewhere
(torch has no such CPU kernel) each row block is widened once after its matmul, and an input
Gram's once for all the layers that read it. With several row blocks, the off-diagonal
columns of each input Gram row block are doubled in place where the block is made (exact: a
power of two), once for all the layers that read it: one elementwise pass over that part of the
input Gram. Each layer then contracts a row block by one batched dot product per row (a ``bmm``
of ``1 x K`` by ``K x 1``), with no elementwise product written and each element of its own
Gram read once, instead of dotting the diagonal block and the rest of the row apart and adding
twice the second: four ops (GPU launches) fewer per layer and row block with an off-diagonal
part, for one op per input row block. On CPU, where that ``bmm`` is an order of
magnitude slower than multiplying and summing, the dot products are ``vecdot``s instead
(:data:`PRODUCT_CONTRACTION`).

Block sizes (``gram_block="auto"``, resolved per layer from the activation's device):

- CPU: 64 tokens. Measured with ``memory_test/fsdp_llama3_profiling/gram_blocks.py`` (committed
  in ``results/cpu-2cores-gram-blocks/``): the norms of a ``small`` decoder block 1.0-1.2x as
  fast at ``T = 128``, 1.4x at 256, 1.5x at 512 and 1.8-2.2x at 1024 (two runs).
- CUDA and other accelerators: 512 tokens, chosen without a GPU measurement. Each extra row
  block adds a few kernel launches per layer while the Gram work grows as ``T^2``, so the blocks
  start at ``T > 512`` (two blocks at 1024: 3/4 of the FLOPs) and multiply with longer
  sequences. ``gram_blocks.py`` measures the choice on a GPU.
"""

from __future__ import annotations

import math

import torch

from .kernels.rows import batched_dot_kernel

#: ``gram_block="auto"``: tokens per row block on CPU, and on every other device type.
AUTO_BLOCK_CPU = 64
AUTO_BLOCK_ACCELERATOR = 512


def resolve_block(option: int | str, device: torch.device) -> int:
    """Tokens per row block.

    Args:
        option: ``"auto"`` or a number of tokens (0: full Grams).
        device: Where the Grams are computed (the layer input's device).

    Returns:
        The block size; 0 for full Grams.
    """
    if option == "auto":
        return AUTO_BLOCK_CPU if device.type == "cpu" else AUTO_BLOCK_ACCELERATOR
    return int(option)


def describe_block(option: int | str, device: torch.device) -> str:
    """One log phrase for the ``gram_block`` option on ``device`` (the model's)."""
    block = resolve_block(option, device)
    if not block:
        return f"full Gram matrices (gram_block={option})"
    return (
        f"upper block triangle of the Grams in row blocks of {block} tokens "
        f"(gram_block={option}, {device.type}; full Grams up to {block} tokens)"
    )


def row_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """``[(start, rows), ...]`` of the row blocks of ``t`` positions (one block when off)."""
    if block <= 0 or block >= t:
        return [(0, t)]
    return [(s, min(block, t - s)) for s in range(0, t, block)]


def flop_fraction(t: int, block: int) -> float:
    """The fraction of the full Gram's matmul FLOPs that the upper block triangle computes."""
    if t <= 0:
        return 1.0
    return sum(w * (t - s) for s, w in row_blocks(t, block)) / (t * t)


#: Whether ``torch.bmm(..., out_dtype=)`` runs here for a (device type, dtype): learnt on first
#: use (CUDA: tried; other devices: whether a kernel is registered for their dispatch key).
_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def _may_have_out_dtype(device: torch.device) -> bool:
    """Whether to try ``bmm``'s ``out_dtype`` overload on ``device`` (cached by the caller)."""
    if device.type == "cuda":
        return True
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::bmm.dtype", device.type.upper()
        )
    except RuntimeError:  # a device type without a dispatch key of that name
        return False


def wide_bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` (batched) in fp32 for fp16/bf16 inputs, as is for fp32 and fp64.

    On CUDA (and wherever a kernel for ``aten::bmm.dtype`` is registered, as the op ledger
    does on CPU) the matmul accumulates and writes fp32 itself (``out_dtype``); where torch has
    no such kernel (CPU), its result is widened.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    if x.dtype == wide:
        return torch.bmm(x, y)
    out = try_wide_bmm(x, y)
    return out if out is not None else torch.bmm(x, y).to(wide)


def try_wide_bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """``torch.bmm(x, y, out_dtype=fp32)`` of fp16/bf16 operands where a kernel runs, else None.

    For callers whose fallback is not :func:`wide_bmm`'s (a narrow matmul, then widened) but a
    matmul of widened operands.
    """
    key = (x.device.type, x.dtype)
    if key not in _OUT_DTYPE:
        _OUT_DTYPE[key] = _may_have_out_dtype(x.device)
    if type(x) is torch.Tensor and _OUT_DTYPE[key]:
        try:
            out = torch.bmm(x, y, out_dtype=torch.promote_types(x.dtype, torch.float32))
            _OUT_DTYPE[key] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return None


def upper_gram(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Row blocks of ``x x^T`` per sample, in fp32 (fp64 for fp64), weighted for contraction.

    Row block ``i`` holds rows ``s_i .. s_i + w_i`` against columns ``s_i .. T``: its first
    ``w_i`` columns are the diagonal block, as they are; the rest, which stand for themselves
    and their mirror image below the diagonal, are doubled (exactly), so that
    :func:`contract_output_grams` contracts each row block in one pass. One block (``block``
    0 or ``>= T``) is the full Gram, as it is.

    Args:
        x: ``(N, T, d)``.
        block: Tokens per row block; 0 (or ``>= T``) gives the full Gram as one block.

    Returns:
        One ``(N, w_i, T - s_i)`` tensor per row block of :func:`row_blocks`.
    """
    xt = x.transpose(1, 2)
    blocks = row_blocks(x.shape[1], block)
    if len(blocks) == 1:  # the full Gram: no slicing views (the same matmul)
        return [wide_bmm(x, xt)]
    out = []
    for s, w in blocks:
        row = wide_bmm(x[:, s : s + w], xt[:, :, s:])
        if row.shape[2] > w:
            row[:, :, w:].mul_(2)  # the off-diagonal part counts twice
        out.append(row)
    return out


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 if it is narrower (fp16, bf16); fp32 and fp64 are returned as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


#: Device types whose Gram contractions multiply and sum (``torch.linalg.vecdot``, which writes
#: the elementwise product) instead of a batched matmul of ``1 x K`` by ``K x 1`` rows (which
#: writes none). On CPU torch's batched matmul of such rows is the slow one: 36 against 5 us
#: at ``N = 4, T = 64`` and 135 against 11 us at ``T = 128`` (one core, this project's CI
#: machine); the product is one transient buffer the size of the row block it contracts (a
#: full ``N x T x T`` fp32 Gram with one block). Elsewhere the matmul saves that traffic. The
#: op ledger removes ``"cpu"`` while it counts the accelerator's ops
#: (:func:`~opacus_fsdp_sync.bench.accelerator_ops.accelerator_matmuls`).
PRODUCT_CONTRACTION: set[str] = {"cpu"}


def _by_product(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.device.type in PRODUCT_CONTRACTION


def batched_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N,)``: ``sum(a[n] * b[n])``, by a batched matmul (no product written) or ``vecdot``.

    ``a`` and ``b`` are contiguous ``(N, ...)`` tensors of one shape and dtype; the route is
    :data:`PRODUCT_CONTRACTION`'s for their device. Large fp32 operands on CUDA take a Triton
    kernel instead (:func:`.kernels.rows.batched_dot_kernel`, equal to rounding). Otherwise,
    off the product route, a Gram block (``(N, w, K)``, more than one row) is contracted row
    by row (:func:`_row_dots`): one ``1 x (w K)`` by ``(w K) x 1`` product per sample ran as a
    matrix-vector kernel with too few blocks for the GPU: 158 us a call on an H100 (about 100
    GB/s for a Gram block of 512 rows at batch 8), where row products of the same size took
    12 us (``results/ledger/row-dots/README.md``).
    """
    fast = batched_dot_kernel(a, b)  # CUDA, fp32: a Triton kernel (.kernels.rows)
    if fast is not None:
        return fast
    n, k = a.shape[0], math.prod(a.shape[1:])  # k explicit: an empty batch has no -1 to infer
    if _by_product(a):
        return torch.linalg.vecdot(a.reshape(n, k), b.reshape(n, k))
    if a.dim() == 3 and a.shape[1] > 1:
        return _row_dots(a, b)
    return torch.bmm(a.reshape(n, 1, k), b.reshape(n, k, 1)).view(n)


def _row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N,)``: the batched dot of ``(N, w, K)`` row blocks, one batched matmul of row pairs.

    ``N w`` products of a ``1 x K`` row by a ``K x 1`` row, summed over the ``w`` rows of each
    sample.
    """
    n, w, k = a.shape
    rows = torch.bmm(a.reshape(n * w, 1, k), b.reshape(n * w, k, 1))
    return rows.view(n, w).sum(1)


def contract_output_grams(
    aat: list[torch.Tensor] | None, g: torch.Tensor, block: int, *, bias: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Squared per-sample norms from the row blocks of ``G G^T``, each dropped after its use.

    Args:
        aat: :func:`upper_gram` of the layer input with the same ``block`` (off-diagonal parts
            doubled), or None when the weight is frozen.
        g: The output gradient ``(N, T, d_out)``.
        block: Tokens per row block (0: full Grams).
        bias: Whether to return the bias term ``|sum_t g_t|^2`` (the sum of ``G G^T``).

    Returns:
        ``(weight_sq, bias_sq)``, each ``(N,)`` in at least fp32, or None where not asked for.
    """
    wide = torch.promote_types(g.dtype, torch.float32)
    # the bias term |sum_t g_t|^2 directly: the sum of G G^T without its Gram
    b_sq = g.sum(1, dtype=wide).pow(2).sum(1) if bias else None
    if aat is None:
        return None, b_sq
    w_sq = None
    gt = g.transpose(1, 2)
    blocks = row_blocks(g.shape[1], block)
    for a_i, (s, w) in zip(aat, blocks):
        ggt = wide_bmm(g, gt) if len(blocks) == 1 else wide_bmm(g[:, s : s + w], gt[:, :, s:])
        # the input Gram's off-diagonal part is doubled already (upper_gram): one pass
        part = batched_dot(a_i.to(ggt.dtype), ggt)
        w_sq = part if w_sq is None else w_sq + part
    return w_sq, b_sq
