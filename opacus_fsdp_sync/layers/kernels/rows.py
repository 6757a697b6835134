"""Where the row kernels (:mod:`.triton_rows`) replace torch ops, and the calls that choose.

Two memory-bound steps of every private step run as Triton kernels where they can:

- :func:`scale_rows_kernel`: the clipping coefficients applied to a layer's narrower operand
  before its clipped-gradient matmul (bit for bit torch's product, so the choice never changes
  a result);
- :func:`batched_dot_kernel`: the contraction of fp32 Gram blocks into squared norms (the same
  sum in another order: equal to rounding).

``OPACUS_FSDP_SYNC_ROW_KERNELS`` chooses: unset or ``auto`` on CUDA tensors of at least
:data:`SCALE_MIN_ELEMENTS` / :data:`DOT_MIN_ELEMENTS` elements where Triton imports; ``0`` never
(the torch ops everywhere); ``1`` wherever Triton can launch, the CPU under
``TRITON_INTERPRET=1`` included (the tests).

Why the sizes: on one H100 (``memory_test/fsdp_llama3_profiling/results/gpu-h100-campaign/
row-kernels/``) the kernels moved 2.5-2.9 TB/s where torch's ops moved 0.9-1.3 TB/s, but a
Triton launch cost that machine's host 48-64 us against 28-48 us for the torch ops it
replaces. Below these sizes torch's op is done before the kernel's launch is: a private step
bound by its host (small Poisson draws) would only pay the launches.

Each call returns None where the kernel does not apply (another device, fp64, a non-contiguous
tensor, more samples than a grid column takes), and the caller runs its torch op. Triton is
imported on the first call that needs it.
"""

from __future__ import annotations

import os

import torch

from .availability import can_launch

#: The environment variable that turns the row kernels on or off (see the module docstring).
ENV = "OPACUS_FSDP_SYNC_ROW_KERNELS"
#: Dtypes the row kernels read (fp64 keeps the torch ops).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: CUDA's limit on a grid's second dimension, which the kernels give the rows.
MAX_ROWS = 65535
#: ``auto``: the smallest tensors the kernels take (elements of the scaled tensor; of each dot
#: operand). The scale of a ``(8, 1024, 2048)`` bf16 operand took 75.6 us in torch and 45.4 us
#: as a kernel (bound by its launch), that of ``(4, 1024, 2048)`` 37.3 against 43.9 us; the
#: dot of two ``(8, 1024, 1024)`` fp32 Grams 26 us a call in the step's profile against the
#: 47 us of cuBLAS's matrix-vector kernel.
SCALE_MIN_ELEMENTS = 1 << 24
DOT_MIN_ELEMENTS = 1 << 23


def setting() -> str:
    """``"auto"``, ``"0"`` or ``"1"``: the value of :data:`ENV` (unset is ``"auto"``).

    Raises:
        ValueError: Any other value.
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: use auto (the default: CUDA), 0 (off) or 1 (on)")
    return value


def wanted(device_type: str, numel: int, minimum: int) -> bool:
    """Whether :func:`setting` asks for a row kernel on a tensor of ``numel`` elements.

    ``auto``: on CUDA from ``minimum`` elements; ``1``: always; ``0``: never.
    """
    choice = setting()
    if choice == "auto":
        return device_type == "cuda" and numel >= minimum
    return choice == "1"


def _applies(minimum: int, *tensors: torch.Tensor) -> bool:
    """Whether the setting, the device, the size, the rows and the layout let a kernel run."""
    first = tensors[0]
    if not wanted(first.device.type, first.numel(), minimum):
        return False
    if type(first) is not torch.Tensor or first.dim() == 0 or first.shape[0] > MAX_ROWS:
        return False
    return all(t.is_contiguous() for t in tensors) and can_launch(*tensors)


def scale_rows_kernel(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """``t`` with row n times ``scale[n]`` in ``dtype`` by the kernel, or None.

    None where the kernel does not apply: ``t`` or ``dtype`` not fp32/bf16/fp16, ``scale`` not
    an fp32 ``(N,)``, or :func:`_applies` says no.
    """
    if t.dtype not in _DTYPES or dtype not in _DTYPES or scale.dtype != torch.float32:
        return None
    if t.dim() == 0 or scale.shape != (t.shape[0],):
        return None
    if not _applies(SCALE_MIN_ELEMENTS, t, scale):
        return None
    from . import triton_rows

    return triton_rows.scale_rows(t, scale, dtype)


def batched_dot_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``(N,)``: ``sum(a[n] * b[n])`` of fp32 ``a`` and ``b`` (one shape) by the kernel, or None.

    None where the kernel does not apply (another dtype or shape, or :func:`_applies` says no).
    """
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.shape != b.shape:
        return None
    if not _applies(DOT_MIN_ELEMENTS, a, b):
        return None
    from . import triton_rows

    return triton_rows.batched_dot(a, b)
