"""Whether the fused kernels can run, and whether they should for a given layer's tensors.

Triton is a dependency only where CUDA is (PyTorch's CUDA wheels bring it): this module never
imports it at import time, so the package imports and falls back to the torch path without it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

#: Dtypes the kernels take (others, fp64 included, keep the torch path).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The log phrase of ``fused_kernels=None``, the torch path on every device: the GPU campaign's
#: A/B on one H100 (Llama-3.2-1B shape, batch 8, seq 1024, bf16;
#: ``memory_test/fsdp_llama3_profiling/results/gpu-h100-campaign/fused-by-default/``) measured
#: the fused kernels slower in both places they run (``docs/kernels.md``).
AUTOMATIC = (
    "torch path (fused_kernels=None; the fused kernels, measured slower on an H100, "
    "are opt-in with fused_kernels=True)"
)


#: Spellings of an ``auto | 0 | 1`` kernel switch's values (as ``TRITON_INTERPRET`` takes them).
_SPELLINGS = {
    "auto": "auto",
    "": "auto",
    "1": "1",
    "true": "1",
    "on": "1",
    "yes": "1",
    "0": "0",
    "false": "0",
    "off": "0",
    "no": "0",
}


class EnvSwitch:
    """A kernel switch read from an environment variable: ``auto`` (unset), ``0`` or ``1``.

    Read once (on first use, or by :meth:`refresh`, which ``make_private`` calls): reading the
    environment at every call cost a declined row-kernel call about 0.7 of its 2.2 us.

    Args:
        env: The variable's name.
        auto_means: What ``auto`` does, in words, for the error message.
    """

    def __init__(self, env: str, auto_means: str):
        self.env = env
        self.auto_means = auto_means
        #: The value as last read (None: not read yet).
        self.value: str | None = None

    def refresh(self) -> str:
        """Reads the variable again.

        Returns:
            ``"auto"`` (unset, empty or ``auto``), ``"1"`` (``1``, ``true``, ``on``, ``yes``) or
            ``"0"`` (``0``, ``false``, ``off``, ``no``), in any case.

        Raises:
            ValueError: Any other value, naming the variable and what it takes.
        """
        raw = os.environ.get(self.env)
        value = _SPELLINGS.get((raw or "").strip().lower())
        if value is None:
            raise ValueError(
                f"{self.env}={raw!r}: use auto (the default: {self.auto_means}), 0 (off) or 1 "
                "(on wherever Triton can launch)"
            )
        self.value = value
        return value

    def setting(self) -> str:
        """The value as last read (:meth:`refresh` on first use)."""
        return self.value or self.refresh()

    def describe(self, available: bool, *, off: str, unavailable: str, on: str, auto: str) -> str:
        """One log phrase for the setting, read and validated again (``make_private``'s call).

        Args:
            available: Whether Triton imports here.
            off: The phrase for ``0``.
            unavailable: The phrase for ``auto`` or ``1`` without Triton.
            on: The phrase for ``1``.
            auto: The phrase for ``auto``.

        Returns:
            The phrase, with the variable and its value.

        Raises:
            ValueError: The variable has a value :meth:`refresh` does not take.
        """
        choice = self.refresh()
        if choice == "0":
            phrase = off
        elif not available:
            phrase = unavailable
        else:
            phrase = on if choice == "1" else auto
        return f"{phrase} ({self.env}={choice})"


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (checked once, by import)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as error:  # noqa: BLE001 - a broken install is the same as none
        logger.info("[Ghost] triton is installed but does not import (%s): torch path", error)
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def can_launch(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``tensors``: CUDA, or CPU under the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    (device,) = devices
    on_device = device.type == "cuda" or (device.type == "cpu" and interpreting())
    return on_device and triton_available()  # the import is tried only where it can matter


def use_fused(option: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether the ``Linear`` room takes the fused kernels for ``tensors``.

    Args:
        option: :attr:`~opacus_fsdp_sync.options.GhostOptions.fused_kernels`: True on CUDA
            tensors, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, for tests);
            None (the default) and False never: on an H100 the torch path was measured faster
            (:data:`AUTOMATIC`).
        *tensors: The layer input and output gradient (local tensors).

    Returns:
        True when the kernels apply: a supported dtype (fp32, bf16, fp16) on a device where
        Triton can launch them.
    """
    if option is not True or not tensors or not all(t.dtype in DTYPES for t in tensors):
        return False
    return can_launch(*tensors)


def describe(option: bool | None, device: torch.device) -> str:
    """One log phrase: whether the fused kernels run for a model on ``device``, and why.

    Raises:
        ValueError: ``option`` is True and Triton does not import.
    """
    if option is True and not triton_available():
        raise ValueError(
            "fused_kernels=True needs triton, which does not import here: install it (CUDA "
            "wheels of torch bring it; `pip install -e .[kernels-test]` for the CPU "
            "interpreter) or leave fused_kernels=None"
        )
    if option is False:
        return "torch path (fused_kernels=False)"
    if option is None:
        return AUTOMATIC
    if device.type != "cuda" and not interpreting():
        return f"torch path (fused_kernels={option}: {device.type} is not CUDA)"
    return f"fused Triton kernels (fused_kernels={option}, {device.type})"
