"""Where the row kernels (:mod:`.triton_rows`) replace torch ops, and the calls that choose.

Two memory-bound steps of every private step run as Triton kernels where they can:

- :func:`scale_rows_kernel`: the clipping coefficients applied to a layer's narrower operand
  before its clipped-gradient matmul (on CUDA bit for bit torch's product, so the choice does
  not change a result; Triton's CPU interpreter flushes bf16 subnormals);
- :func:`batched_dot_kernel`: the contraction of fp32 Gram blocks into squared norms (the same
  sum in another order: equal to rounding).

``OPACUS_FSDP_SYNC_ROW_KERNELS`` chooses: unset or ``auto`` on CUDA tensors of at least
:data:`SCALE_MIN_ELEMENTS` / :data:`DOT_MIN_ELEMENTS` elements where Triton imports; ``0`` never
(the torch ops everywhere); ``1`` wherever Triton can launch, the CPU under
``TRITON_INTERPRET=1`` included (the tests).

Why the sizes (one H100, ``memory_test/fsdp_llama3_profiling/results/gpu-h100-campaign/
row-kernels/``): a Triton launch cost that machine's host 48-64 us against 28-48 us for the
torch ops it replaces (15.6-19.2 us more), so a kernel pays only where torch's op takes longer
on the GPU than the launch on the host. The scaling kernel moved 1.5 TB/s at ``(8, 1024, 2048)``
bf16 (bound by its launch) and 2.9 TB/s at ``(8, 1024, 8192)``, against torch's 0.9 TB/s. The
dot kernel lost to torch in back-to-back calls at every size (bound by its launch); inside the
step, where the host runs ahead, it took 26.2 us a call on ``(8, 1024, 1024)`` Grams against
45.6 us for cuBLAS's matrix-vector kernel. Below the sizes a step bound by its host (small
Poisson draws) would only pay the launches. The sizes themselves are set from these figures, not
measured.

Each call returns None where the kernel does not apply (another device, fp64, a non-contiguous
tensor or DTensor, an input that requires a gradient, more samples than a grid column takes),
and the caller runs its torch op. Triton is imported on the first call that needs it; if a
launch fails (Triton cannot compile here, say), the failure is logged once and the device keeps
the torch ops: the scaling's result is the same, the dots' equal to rounding. Raw Triton
launches are not dispatcher ops: dispatch-mode tools (the op ledger, ``FlopCounterMode``) do
not see them on CUDA.
"""

from __future__ import annotations

import logging

import torch

from .availability import DTYPES, EnvSwitch, can_launch, triton_available

logger = logging.getLogger(__name__)

#: The environment variable that turns the row kernels on or off (see the module docstring).
ENV = "OPACUS_FSDP_SYNC_ROW_KERNELS"
#: CUDA's limit on a grid's second dimension, which the kernels give the rows.
MAX_ROWS = 65535
#: ``auto``: the smallest tensors the kernels take (elements of the scaled tensor; of each dot
#: operand). The scale of a ``(8, 1024, 2048)`` bf16 operand took 75.6 us in torch and 45.4 us
#: as a kernel (bound by its launch), that of ``(4, 1024, 2048)`` 37.3 against 43.9 us; the
#: dot of two ``(8, 1024, 1024)`` fp32 Grams 26.2 us a call in the step's profile against the
#: 45.6 us of cuBLAS's matrix-vector kernel (another machine's profile of the same step).
SCALE_MIN_ELEMENTS = 1 << 24
DOT_MIN_ELEMENTS = 1 << 23
#: Devices where a launch failed: they keep the torch ops for the rest of the process.
_FAILED: set[torch.device] = set()
#: :data:`ENV`, read once (:func:`refresh` reads it again).
_SWITCH = EnvSwitch(ENV, "large CUDA tensors")


def refresh() -> str:
    """Reads :data:`ENV` again (``make_private`` does, through :func:`describe`).

    Returns:
        ``"auto"``, ``"1"`` or ``"0"`` (:meth:`.availability.EnvSwitch.refresh`).

    Raises:
        ValueError: Any other value, naming the variable and what it takes.
    """
    return _SWITCH.refresh()


def setting() -> str:
    """The row kernels' setting: :data:`ENV` as last read (:func:`refresh` on first use).

    Returns:
        ``"auto"``, ``"1"`` or ``"0"`` (see :func:`refresh`).
    """
    return _SWITCH.setting()


def describe() -> str:
    """One log phrase: whether the row kernels run, and where (reads and validates :data:`ENV`).

    Returns:
        The setting in words, with a note where Triton does not import here.

    Raises:
        ValueError: :data:`ENV` has a value :func:`setting` does not take.
    """
    return _SWITCH.describe(
        triton_available(),
        off="row kernels off",
        unavailable="row kernels unavailable: triton does not import",
        on="row kernels wherever Triton launches",
        auto=f"row kernels on CUDA tensors from {SCALE_MIN_ELEMENTS} (scaling) / "
        f"{DOT_MIN_ELEMENTS} (Gram dots) elements",
    )


def wanted(device_type: str, numel: int, minimum: int) -> bool:
    """Whether :func:`setting` asks for a row kernel on a tensor of ``numel`` elements.

    Args:
        device_type: The tensor's device type.
        numel: Its elements.
        minimum: The kernel's ``auto`` size (:data:`SCALE_MIN_ELEMENTS`,
            :data:`DOT_MIN_ELEMENTS`).

    Returns:
        ``auto``: on CUDA from ``minimum`` elements; ``1``: always; ``0``: never.
    """
    choice = setting()
    if choice == "auto":
        return device_type == "cuda" and numel >= minimum
    return choice == "1"


def _applies(minimum: int, *tensors: torch.Tensor) -> bool:
    """Whether the setting, the device, the size, the rows and the layout let a kernel run."""
    first = tensors[0]
    if not wanted(first.device.type, first.numel(), minimum) or first.device in _FAILED:
        return False
    if any(type(t) is not torch.Tensor for t in tensors):
        return False  # DTensors and other subclasses keep their own ops
    if first.dim() == 0 or first.shape[0] > MAX_ROWS:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # a launch would not be recorded by autograd
    return all(t.is_contiguous() for t in tensors) and can_launch(*tensors)


def _kernels():
    """The launchers (:mod:`.triton_rows`), imported on first use."""
    from . import triton_rows

    return triton_rows


def _launch(name: str, *args) -> torch.Tensor | None:
    """``triton_rows.<name>(*args)`` on the tensors' device; None (logged once) if it fails."""
    device = args[0].device
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):  # Triton launches on the current device
                return getattr(_kernels(), name)(*args)
        return getattr(_kernels(), name)(*args)
    except torch.OutOfMemoryError:
        raise  # the torch op would need the same memory: not the kernel's failure
    except Exception as error:  # noqa: BLE001 - a kernel that cannot run is the torch path
        _FAILED.add(device)
        logger.warning(
            "[Ghost] row kernel %s failed on %s (%s: %s); this device keeps the torch ops",
            name, device, type(error).__name__, error,
        )  # fmt: skip
        return None


def scale_rows_kernel(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """``t`` with row n times ``scale[n]``, by the kernel.

    Args:
        t: ``(N, ...)``, fp32, bf16 or fp16.
        scale: ``(N,)`` fp32 factors.
        dtype: The result's dtype (fp32, bf16 or fp16).

    Returns:
        The product formed in fp32 and rounded once to ``dtype``, or None where the kernel does
        not apply (the caller's torch op computes the same bits).
    """
    if not _applies(SCALE_MIN_ELEMENTS, t, scale):  # first: the CPU's calls decline here
        return None
    if t.dtype not in DTYPES or dtype not in DTYPES or scale.dtype != torch.float32:
        return None
    if scale.shape != (t.shape[0],):
        return None
    return _launch("scale_rows", t, scale, dtype)


def batched_dot_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The dot product of each row pair, by the kernel.

    Args:
        a: ``(N, ...)`` fp32.
        b: Of ``a``'s shape, fp32.

    Returns:
        ``(N,)`` fp32 ``sum(a[n] * b[n])`` (fp32 partials summed by ``torch.sum``), or None
        where the kernel does not apply.
    """
    if not _applies(DOT_MIN_ELEMENTS, a, b):  # first: the CPU's calls decline here
        return None
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.shape != b.shape:
        return None
    return _launch("batched_dot", a, b)
