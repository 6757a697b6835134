"""Where the DP step's noise is drawn inside the add (:mod:`..layers.kernels.triton_noise`).

The torch path draws ``N(0, std^2)`` into a buffer the size of every local gradient (during the
backward, :mod:`.noise_prefetch`) and then adds ``factor * g`` into it: the noise is written
once and read once more. The noise kernel writes ``factor * g + std * z`` in one pass, drawing
``z`` in registers from Philox keyed by a 62-bit key and a 62-bit counter nonce that the
optimizer's noise generator draws on the device at each launch (one launch per noise stream and
dtype), so the noise still comes from that generator: from OS entropy unless the user seeded
it, restarted by ``fresh_noise``, saved in checkpoints. Two launches share noise only if all 124
random bits repeat.

``OPACUS_FSDP_SYNC_NOISE_KERNEL`` chooses: unset or ``auto`` on CUDA tensors where Triton
imports; ``0`` never (the torch path everywhere); ``1`` wherever Triton can launch, the CPU
under ``TRITON_INTERPRET=1`` included (the tests). It is read at ``make_private`` (logged). Only
this package's FSDP2 and FSDP1 optimizers take it; ``secure_mode`` never does (its optimizers
draw from the OS CSPRNG through Opacus).

The two paths give different numbers for the same generator state, so replicas of a shard (HSDP,
``no_shard``, tensor-parallel replicas), which must add the same noise, must take the same path:
the optimizer decides once, at its construction, with every rank (:func:`agree`: probe launches
on each rank for each dtype, waited for, then the minimum over all ranks). After that nothing a
single process sees changes the path: the step launches whatever it gets (a non-contiguous
gradient copied first), and a launch that fails raises instead of falling back.

What differs from the torch path: the numbers, and the rounding of ``factor * g + std * z`` (on
CUDA one fused multiply-add may round once where torch rounds the product and the sum). On CUDA
the largest draw is 6.76 standard deviations on both paths (curand's Box-Muller is the same).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from ..layers.kernels.availability import DTYPES, EnvSwitch, can_launch, triton_available
from ..randomness import comm_device
from .noise_prefetch import flat_views, noise_layout

logger = logging.getLogger(__name__)

#: The environment variable that turns the noise kernel on or off (see the module docstring).
ENV = "OPACUS_FSDP_SYNC_NOISE_KERNEL"
_SWITCH = EnvSwitch(ENV, "CUDA tensors")
#: The kernel's way of drawing, recorded in checkpoints (another version: other noise from the
#: same generator state). v2: a 62-bit key and a 62-bit counter nonce per launch, programs of
#: 4096 elements on CUDA (256 under the interpreter).
VERSION = "v2"
#: Devices where a probe failed (not for lack of memory): later votes decline them.
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
    inside = "FSDP2/FSDP1 noise drawn inside the noised add"
    return _SWITCH.describe(
        triton_available(),
        off="noise drawn by torch",
        unavailable="noise drawn by torch: triton does not import",
        on=f"{inside} wherever Triton launches",
        auto=f"{inside} on CUDA",
    )


def wanted(devices, dtypes=()) -> bool:
    """Whether the setting asks for the kernel on tensors on ``devices`` (an iterable).

    ``auto``: all on CUDA; ``1``: all where Triton can launch; ``0``: never. Devices where a
    probe launch failed, and dtypes the kernel does not take (``dtypes``, if given), decline.
    """
    devices = set(devices)
    choice = _SWITCH.setting()
    if choice == "0" or not devices or devices & _FAILED:
        return False
    if choice == "auto" and any(d.type != "cuda" for d in devices):
        return False
    if any(dtype not in DTYPES for dtype in dtypes):
        return False
    return triton_available()


def applies(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are plain, contiguous, of a kernel dtype, on one launchable device."""
    if not tensors or not wanted(t.device for t in tensors):
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.dtype not in DTYPES or not t.is_contiguous():
            return False
    return can_launch(*tensors)  # one device


def _probe(device: torch.device, dtypes) -> bool:
    """Whether the kernel compiles and runs on ``device`` for each of ``dtypes``.

    Tiny launches, waited for; logged if not. Never raises (out of memory included): every rank
    must reach :func:`agree`'s vote.
    """
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        for dtype in sorted(set(dtypes), key=str):
            out = _launch([torch.ones(5, dtype=dtype, device=device)], gen, 1.0, 1.0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError(f"non-finite output for {dtype}")
    except Exception as error:  # noqa: BLE001 - out of memory included: the vote decides
        if not isinstance(error, torch.OutOfMemoryError):  # memory may be free again later
            _FAILED.add(device)
        logger.warning(
            "[Ghost] noise kernel cannot run on %s (%s: %s); the noise is drawn by torch",
            device, type(error).__name__, error,
        )  # fmt: skip
        return False
    return True


def agree(devices, dtypes) -> bool:
    """Whether the noise kernel runs, decided with every rank (collective when distributed).

    Each rank checks the setting and the devices and dtypes of its gradients (:func:`wanted`)
    and launches the kernel on a tiny tensor of each dtype, waiting for it; the kernel runs only
    if it did on every rank (replicas must add the same noise, and the two paths' numbers differ).

    Args:
        devices: The devices of this rank's gradients.
        dtypes: Their dtypes.

    Returns:
        True on every rank, or False on every rank.
    """
    devices, dtypes = set(devices), set(dtypes)
    ok = wanted(devices, dtypes) and len(devices) == 1 and _probe(next(iter(devices)), dtypes)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([int(ok)], device=comm_device(next(iter(devices), None)))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    agreed = bool(flag.item())
    if ok and not agreed:
        logger.warning("[Ghost] noise kernel off: another rank cannot run it (replicas agree)")
    return agreed


@functools.lru_cache(maxsize=16)
def _table(numels: tuple[int, ...], block: int, device: torch.device):
    """The launch's block table (built once per layout; :func:`.triton_noise.block_table`)."""
    from ..layers.kernels import triton_noise

    return triton_noise.block_table(list(numels), block, device)


def _seed(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A fresh 62-bit Philox key and counter nonce from ``generator``: int64 ``(2,)``.

    Raises:
        ValueError: ``generator`` is not on ``device`` (the copy would synchronise the host).
    """
    if generator.device.type != device.type:
        raise ValueError(
            f"the noise generator is on {generator.device}, the gradients on {device}: the "
            "noise kernel draws its seeds on the gradients' device"
        )
    seed = torch.randint(
        0, 2**62, (2,), generator=generator, dtype=torch.int64, device=generator.device
    )
    return seed.to(device)


def _launch(group: list[torch.Tensor], generator, factor: float, std: float) -> torch.Tensor:
    """The flat noised ``group`` (one dtype and device), by the kernel, on its device."""
    from ..layers.kernels import triton_noise

    device = group[0].device
    block = triton_noise.block_size(device)
    table = _table(tuple(t.numel() for t in group), block, device)
    seed = _seed(generator, device)
    if device.type == "cuda":
        with torch.cuda.device(device):  # Triton launches on the current device
            return triton_noise.noised(group, table, seed, factor, std, block)
    return triton_noise.noised(group, table, seed, factor, std, block)


def noised(
    tensors: list[torch.Tensor], generator, factor: float, std: float
) -> list[torch.Tensor] | None:
    """``factor * t + N(0, std^2)`` for each tensor by the kernel, where the setting takes them.

    For a caller without an agreed path (benchmarks, tests); the optimizers call
    :func:`noised_agreed` after :func:`agree`.

    Returns:
        As :func:`noised_agreed`, or None where :func:`applies` declines the tensors or there
        is no generator.
    """
    if generator is None or not applies(tensors):
        return None
    return noised_agreed(tensors, generator, factor, std)


def noised_agreed(
    tensors: list[torch.Tensor], generator, factor: float, std: float
) -> list[torch.Tensor]:
    """``factor * t + N(0, std^2)`` for each tensor, the noise drawn inside the kernel.

    Nothing here depends on the setting or on this process's history (the path was agreed by
    every rank): the tensors are taken as they are, a non-contiguous one copied first.

    Args:
        tensors: The local gradients of one noise stream, on one device, of kernel dtypes.
        generator: That stream's generator, on their device (a key and a nonce are drawn from
            it per dtype).
        factor: The gradients' scale.
        std: The noise's standard deviation (positive).

    Returns:
        New tensors of the inputs' shapes (views of one flat buffer per dtype).

    Raises:
        ValueError: The tensors span several devices or include a dtype the kernel does not take
            (the model changed after the vote; alike on every replica).
        RuntimeError: A launch failed (falling back on one rank could give replicas different
            noise: the message names the setting that keeps torch's draw on every rank).
    """
    devices = {t.device for t in tensors}
    odd = sorted({str(t.dtype) for t in tensors if t.dtype not in DTYPES})
    if len(devices) > 1 or odd:
        raise ValueError(
            f"the noise kernel was agreed for gradients on one device in fp32, bf16 or fp16; "
            f"these are on {sorted(map(str, devices))} in {odd or 'kernel dtypes'} (was the "
            "model moved or cast after make_private? call make_private after moving it)"
        )

    def launch(key: tuple, idx: list[int]) -> torch.Tensor:
        group = [tensors[i] if tensors[i].is_contiguous() else tensors[i].contiguous() for i in idx]
        try:
            return _launch(group, generator, factor, std)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            raise RuntimeError(
                f"the noise kernel failed on {key[1]} ({type(error).__name__}: {error}); set "
                f"{ENV}=0 to draw the noise with torch on every rank"
            ) from error

    return flat_views(noise_layout(tensors), launch)
