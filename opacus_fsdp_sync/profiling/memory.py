"""Peak memory: CUDA max allocated on GPU, peak resident set size (RSS) on CPU."""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("opacus_fsdp_sync")


def reset_peak(device: torch.device) -> None:
    """Starts a new peak window on CUDA (RSS peaks cannot be reset; they cover the process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float | str]:
    """Returns ``{"kind": ..., "bytes": ...}`` for the device.

    On CUDA: ``max_memory_allocated`` since the last :func:`reset_peak`, plus reserved bytes.
    On CPU: the process's peak RSS (``ru_maxrss``), which includes everything since start.
    """
    if device.type == "cuda":
        return {
            "kind": "cuda_max_allocated",
            "bytes": float(torch.cuda.max_memory_allocated(device)),
            "reserved_bytes": float(torch.cuda.max_memory_reserved(device)),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return {"kind": "cpu_peak_rss", "bytes": float(rss * scale)}


#: Cumulative counters of the CUDA caching allocator that :func:`allocator_counts` reads: failed
#: allocations that freed the cache and retried (each ``cudaFree`` synchronises the device),
#: ``cudaMalloc`` and ``cudaFree`` calls.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's :data:`ALLOCATOR_COUNTERS` so far.

    Two readings around some steps give their allocator churn: a steady step makes no
    ``cudaMalloc`` or ``cudaFree`` and no retry.

    Args:
        device: The device whose allocator is read.

    Returns:
        ``{counter: count}`` on CUDA; ``{}`` elsewhere.
    """
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS}


@dataclass
class AllocatorWatch:
    """Says when the CUDA caching allocator retried allocations between two private steps.

    A retry frees every cached block (``cudaFree`` synchronises the device) and allocates
    again: a step near the card's capacity can lose tens of milliseconds to it without failing.
    The engine calls :meth:`check` at the start of each private backward on CUDA; the first
    retries seen are a warning, later ones debug lines.

    Attributes:
        device: The CUDA device watched.
        retries: Retries seen so far, over every checked step.
    """

    device: torch.device
    retries: int = 0
    _last: dict[str, int] | None = field(default=None, repr=False)

    def check(self) -> int:
        """Reads the counters; returns the retries since the last check (0 at the first).

        Returns:
            The number of allocations retried since the previous call.
        """
        now = allocator_counts(self.device)
        last, self._last = self._last, now
        if not now or last is None:
            return 0
        new = now["num_alloc_retries"] - last["num_alloc_retries"]
        if new > 0:
            level = logging.WARNING if self.retries == 0 else logging.DEBUG
            self.retries += new
            logger.log(
                level,
                "[Ghost] the CUDA caching allocator retried %d allocation(s) since the last "
                "step (%d cudaFree, %d cudaMalloc): each retry frees every cached block and "
                "synchronises the device. Near the card's capacity, try "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a smaller physical batch "
                "(BatchMemoryManager)%s",
                new,
                now["num_device_free"] - last["num_device_free"],
                now["num_device_alloc"] - last["num_device_alloc"],
                "" if level == logging.DEBUG else " (logged once; later retries at debug level)",
            )
        return new


def memory_summary(device: torch.device) -> dict[str, float | str]:
    """Allocated, peak and reserved bytes on CUDA; current and peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "kind": "cuda",
            "allocated_bytes": float(torch.cuda.memory_allocated(device)),
            "peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
            "reserved_bytes": float(torch.cuda.memory_reserved(device)),
        }
    current = 0.0
    try:
        with open("/proc/self/statm") as f:
            current = float(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux
        pass
    return {"kind": "cpu", "rss_bytes": current, "peak_rss_bytes": peak_memory(device)["bytes"]}


def size_text(n: float) -> str:
    """Bytes for a log line: GiB, MiB or KiB, one decimal (small models would read 0.0 MiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"
