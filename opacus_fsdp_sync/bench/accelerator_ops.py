"""The accelerator's widening matmuls on CPU, for the op ledger only.

On CUDA, :func:`~opacus_fsdp_sync.layers.linear_grams.wide_bmm` writes an fp32 Gram block from
bf16/fp16 operands in one ``aten::bmm.dtype`` call; CPU torch has no kernel for that overload,
so there the block is computed narrow and widened by a separate ``_to_copy``. A ledger of the
CPU path therefore counts copies the accelerator never makes.

:func:`accelerator_matmuls` registers CPU kernels for ``aten::bmm.dtype``, ``aten::mm.dtype``
and ``aten::baddbmm.dtype`` (fp32 arithmetic on the widened operands, result in the requested
dtype) for the duration of a ``with`` block, resets ``wide_bmm``'s cached probe on entry and
exit, and contracts the Grams by batched matmuls as on an accelerator (not by the CPU's
products, :data:`~opacus_fsdp_sync.layers.linear_grams.PRODUCT_CONTRACTION`), so that inside
the block the code dispatches exactly the ops of the CUDA path. A dispatch
mode sees each such call as one op: the kernel's own ops run below the mode. The registration is
removed on exit; nothing outside the block sees it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from ..layers import linear_grams

logger = logging.getLogger(__name__)

#: The overloads registered, by name.
OVERLOADS = ("bmm.dtype", "mm.dtype", "baddbmm.dtype")


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _bmm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.bmm(_wide(a), _wide(b)).to(out_dtype)


def _mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.mm(_wide(a), _wide(b)).to(out_dtype)


def _baddbmm_dtype(
    c: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> torch.Tensor:
    return torch.baddbmm(_wide(c), _wide(a), _wide(b), beta=beta, alpha=alpha).to(out_dtype)


def has_cpu_kernel(overload: str = "bmm.dtype") -> bool:
    """Whether ``aten::{overload}`` has a CPU kernel in this process now."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{overload}", "CPU")


@contextlib.contextmanager
def accelerator_matmuls() -> Iterator[None]:
    """CPU kernels of the widening matmul overloads, registered for the block's duration.

    Overloads that already have a CPU kernel (a torch that ships one) are left as they are.

    Yields:
        None; on exit the registrations are removed and ``wide_bmm``'s probe is reset.
    """
    kernels = {"bmm.dtype": _bmm_dtype, "mm.dtype": _mm_dtype, "baddbmm.dtype": _baddbmm_dtype}
    missing = [name for name in OVERLOADS if not has_cpu_kernel(name)]
    lib = torch.library.Library("aten", "IMPL") if missing else None
    for name in missing:
        lib.impl(name, kernels[name], "CPU")
    linear_grams._OUT_DTYPE.clear()
    if missing:
        logger.info("[Ghost] ledger: CPU kernels of aten::%s for the accelerator path", missing)
    try:
        with accelerator_contraction():
            yield
    finally:
        if lib is not None:
            lib._destroy()
        linear_grams._OUT_DTYPE.clear()


@contextlib.contextmanager
def accelerator_contraction() -> Iterator[None]:
    """Gram contractions by batched matmuls on every device for the block's duration.

    Empties :data:`~opacus_fsdp_sync.layers.linear_grams.PRODUCT_CONTRACTION` (the accelerator's
    contraction: no product written) and restores it on exit, also on error.

    Yields:
        None.
    """
    by_product = set(linear_grams.PRODUCT_CONTRACTION)
    linear_grams.PRODUCT_CONTRACTION.clear()
    try:
        yield
    finally:
        linear_grams.PRODUCT_CONTRACTION.update(by_product)
