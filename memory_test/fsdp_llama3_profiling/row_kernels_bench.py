"""Torch ops against the row kernels (``opacus_fsdp_sync.layers.kernels.rows``) on one GPU.

At the Llama-3.2-1B shapes (T = 1024; widths 512, 2048, 8192; batches 8, 4, 1): the
clipping coefficients' row scaling of a bf16 operand and the batched dot of two fp32 Gram
blocks, each timed with CUDA events over 50 back-to-back calls (so a call is bound by whichever
is slower, the GPU work or the host's launch), then the host time of one launch (``perf_counter``
over 200 calls without a synchronisation). ``OPACUS_FSDP_SYNC_ROW_KERNELS`` switches between
the two paths (``0``: torch; ``1``: the kernels, whatever the size). Needs CUDA and Triton:

    python memory_test/fsdp_llama3_profiling/row_kernels_bench.py > rows_bench.txt

The GPU campaign runs it as its ``rows`` part.
"""

from __future__ import annotations

import os
import time

import torch

from opacus_fsdp_sync.layers import linear_grams
from opacus_fsdp_sync.layers.kernels import rows
from opacus_fsdp_sync.layers.registry import scale_rows


def timed_us(fn, reps: int = 50) -> float:
    """Mean microseconds of ``fn`` over ``reps`` back-to-back calls (CUDA events)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def host_us(fn, reps: int = 20) -> float:
    """Host microseconds of one call of ``fn`` (no synchronisation inside the loop)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    return host


def both(fn) -> tuple[float, float]:
    """``(torch us, kernel us)`` of ``fn`` under each setting."""
    os.environ[rows.ENV] = "0"
    rows.refresh()
    plain = timed_us(fn)
    os.environ[rows.ENV] = "1"
    rows.refresh()
    return plain, timed_us(fn)


def main() -> None:
    """Prints one line per shape and path, then the host time of a launch."""
    if not torch.cuda.is_available():
        raise SystemExit("row_kernels_bench.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in (8, 4, 1):
        for d in (512, 2048, 8192):
            t = torch.randn(b, 1024, d, device="cuda", generator=gen).bfloat16()
            c = torch.rand(b, device="cuda", generator=gen)
            plain, kernel = both(lambda t=t, c=c: scale_rows(t, c))
            gb = t.numel() * 4 / 1e9  # read and written, 2 bytes each
            print(
                f"scale_rows bf16 ({b},1024,{d}): torch {plain:.1f} us ({gb / plain * 1e6:.0f} "
                f"GB/s), kernel {kernel:.1f} us ({gb / kernel * 1e6:.0f} GB/s)"
            )
        for w in (1024, 512):
            a = torch.randn(b, w, 1024, device="cuda", generator=gen)
            x = torch.randn(b, w, 1024, device="cuda", generator=gen)
            plain, kernel = both(lambda a=a, x=x: linear_grams.batched_dot(a, x))
            gb = a.numel() * 8 / 1e9  # two fp32 operands read
            print(
                f"batched_dot fp32 ({b},{w},1024): torch {plain:.1f} us ({gb / plain * 1e6:.0f} "
                f"GB/s), kernel {kernel:.1f} us ({gb / kernel * 1e6:.0f} GB/s)"
            )
    t = torch.randn(8, 1024, 2048, device="cuda").bfloat16()
    c = torch.rand(8, device="cuda")
    a = torch.randn(8, 512, 1024, device="cuda")
    calls = (
        ("scale_rows", lambda: scale_rows(t, c)),
        ("batched_dot", lambda: linear_grams.batched_dot(a, a)),
    )
    for name, fn in calls:
        for value in ("0", "1"):
            os.environ[rows.ENV] = value
            rows.refresh()
            print(f"host per call {name} row_kernels={value}: {host_us(fn, 200):.1f} us")


if __name__ == "__main__":
    main()
