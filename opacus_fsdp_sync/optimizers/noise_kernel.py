"""Where the DP step's noise is drawn inside the add (:mod:`..layers.kernels.triton_noise`).

The torch path draws ``N(0, std^2)`` into a buffer the size of every local gradient (during the
backward, :mod:`.noise_prefetch`) and then adds ``factor * g`` into it: the noise is written
once and read once more. The noise kernel writes ``factor * g + std * z`` in one pass, drawing
``z`` in registers from Philox keyed by a 64-bit seed that the optimizer's noise generator draws
on the device at each step (one seed per noise stream and dtype), so the noise still comes from
that generator: from OS entropy unless the user seeded it, restarted by ``fresh_noise``, saved
in checkpoints. A seed is never reused: every step draws new ones.

``OPACUS_FSDP_SYNC_NOISE_KERNEL`` chooses: unset or ``auto`` on CUDA tensors where Triton
imports; ``0`` never (the torch path everywhere); ``1`` wherever Triton can launch, the CPU
under ``TRITON_INTERPRET=1`` included (the tests). It is read at ``make_private`` (logged) and
on first use. The kernel takes contiguous plain tensors of fp32, bf16 or fp16 on one device;
anything else, a generator on another device or a failed launch (logged once; the device then
keeps the torch path) takes the torch path. ``secure_mode`` never gets here (its optimizers
draw from the OS CSPRNG through Opacus).

What differs from the torch path: the numbers (another use of the generator), the tail (the
kernel's ``|z|`` reaches 6.76 standard deviations, torch's CUDA ``normal_`` 6.66) and the
rounding (one fused multiply-add may round where torch rounds the product and the sum).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..layers.kernels.availability import DTYPES, EnvSwitch, can_launch, triton_available

logger = logging.getLogger(__name__)

#: The environment variable that turns the noise kernel on or off (see the module docstring).
ENV = "OPACUS_FSDP_SYNC_NOISE_KERNEL"
_SWITCH = EnvSwitch(ENV, "CUDA tensors")
#: Devices where a launch failed: they keep the torch path for the rest of the process.
_FAILED: set[torch.device] = set()


def refresh() -> str:
    """Reads :data:`ENV` again (``make_private`` does, through :func:`describe`).

    Returns:
        ``"auto"``, ``"1"`` or ``"0"`` (:meth:`..layers.kernels.availability.EnvSwitch.refresh`).

    Raises:
        ValueError: Any other value, naming the variable and what it takes.
    """
    return _SWITCH.refresh()


def describe() -> str:
    """One log phrase: whether the noise kernel runs, and where (reads and validates :data:`ENV`).

    Raises:
        ValueError: :data:`ENV` has a value :func:`refresh` does not take.
    """
    choice = refresh()
    if choice == "0":
        return f"noise drawn by torch ({ENV}=0)"
    if not triton_available():
        return f"noise drawn by torch: triton does not import ({ENV}={choice})"
    where = "wherever Triton launches" if choice == "1" else "on CUDA"
    return f"noise drawn inside the noised add {where} ({ENV}={choice})"


def wanted(devices) -> bool:
    """Whether the setting asks for the kernel on tensors on ``devices`` (an iterable).

    ``auto``: all on CUDA; ``1``: all where Triton can launch; ``0``: never. Devices where a
    launch failed are declined.
    """
    devices = set(devices)
    choice = _SWITCH.setting()
    if choice == "0" or not devices or devices & _FAILED:
        return False
    if choice == "auto" and any(d.type != "cuda" for d in devices):
        return False
    return triton_available()


def _applies(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are plain, contiguous, of a kernel dtype, on one launchable device."""
    if not tensors or not wanted(t.device for t in tensors):
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.dtype not in DTYPES or not t.is_contiguous():
            return False
    return can_launch(*tensors)  # one device


@functools.lru_cache(maxsize=16)
def _table(numels: tuple[int, ...], block: int, device: torch.device):
    """The launch's block table (built once per layout; :func:`.triton_noise.block_table`)."""
    from ..layers.kernels import triton_noise

    return triton_noise.block_table(list(numels), block, device)


def _seed(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A fresh 62-bit Philox key from ``generator``, as an int64 ``(1,)`` tensor on ``device``."""
    seed = torch.randint(
        0, 2**62, (1,), generator=generator, dtype=torch.int64, device=generator.device
    )
    return seed.to(device)


def _launch(group: list[torch.Tensor], generator, factor: float, std: float) -> torch.Tensor:
    """The flat noised ``group`` (one dtype and device), by the kernel."""
    from ..layers.kernels import triton_noise

    device = group[0].device
    block = triton_noise.block_size(device)
    table = _table(tuple(t.numel() for t in group), block, device)
    return triton_noise.noised(group, table, _seed(generator, device), factor, std, block)


def noised(
    tensors: list[torch.Tensor], generator, factor: float, std: float
) -> list[torch.Tensor] | None:
    """``factor * t + N(0, std^2)`` for each tensor, the noise drawn inside the kernel.

    Args:
        tensors: The local gradients of one noise stream.
        generator: That stream's generator (a seed is drawn from it per dtype and device).
        factor: The gradients' scale.
        std: The noise's standard deviation (positive).

    Returns:
        New tensors of the inputs' shapes (views of one flat buffer per dtype and device), or
        None where the kernel does not apply (the caller takes the torch path).
    """
    if generator is None or not _applies(tensors):
        return None
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for (_, device), idx in groups.items():
        group = [tensors[i] for i in idx]
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):  # Triton launches on the current device
                    flat = _launch(group, generator, factor, std)
            else:
                flat = _launch(group, generator, factor, std)
        except torch.OutOfMemoryError:
            raise  # the torch path needs a buffer of the same size
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run is the torch path
            _FAILED.add(device)
            logger.warning(
                "[Ghost] noise kernel failed on %s (%s: %s); this device draws with torch",
                device, type(error).__name__, error,
            )  # fmt: skip
            return None
        for i, part in zip(idx, flat.split([t.numel() for t in group])):
            out[i] = part.view(tensors[i].shape)
    return out
