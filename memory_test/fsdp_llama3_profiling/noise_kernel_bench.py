"""The DP step's noise on one GPU: torch's draw and add against the noise kernel.

For the local gradients of Llama-3.2-1B on one GPU (its 146 parameter shapes, fp32, 1.24 G
elements), each path timed with CUDA events over 10 back-to-back calls: torch's path draws
``N(0, std^2)`` into one flat buffer (:func:`~opacus_fsdp_sync.optimizers.noise_prefetch.
draw_flat_noise`) and adds the scaled gradients into it (one ``_foreach_add_``); the noise
kernel (:mod:`opacus_fsdp_sync.optimizers.noise_kernel`) writes ``factor * g + std * z`` in one
pass. Then the host time of one call of each (``perf_counter`` over 20 calls). Needs CUDA and
Triton:

    python memory_test/fsdp_llama3_profiling/noise_kernel_bench.py > noise_bench.txt

The GPU campaign runs it as its ``noise`` part.
"""

from __future__ import annotations

import os

import torch
from row_kernels_bench import (  # this folder's (the script's directory is on sys.path)
    host_us,
    timed_us,
)

from opacus_fsdp_sync.optimizers import noise_kernel
from opacus_fsdp_sync.optimizers.noise_prefetch import draw_flat_noise, noise_layout
from opacus_fsdp_sync.optimizers.noised_step import add_scaled_into


def llama_1b_shapes() -> list[tuple[int, ...]]:
    """The trainable parameter shapes of Llama-3.2-1B (tied head), in module order."""
    hidden, inter, kv, vocab = 2048, 8192, 512, 128256
    block = [
        (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
        (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,),
    ]  # fmt: skip
    return [(vocab, hidden), *block * 16, (hidden,)]


def main() -> None:
    """Prints each path's device and host time and the kernel's noise statistics."""
    if not torch.cuda.is_available():
        raise SystemExit("noise_kernel_bench.py needs a CUDA device")
    os.environ[noise_kernel.ENV] = "1"
    noise_kernel.refresh()
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(s, device="cuda", generator=gen) for s in llama_1b_shapes()]
    numel = sum(g.numel() for g in grads)
    layout = noise_layout(grads)
    factor, std = 1 / 8, 1e-3

    def torch_path():
        noise = draw_flat_noise(layout, std, gen)
        add_scaled_into(noise, grads, factor)
        return noise

    def kernel_path():
        out = noise_kernel.noised(grads, gen, factor, std)
        assert out is not None, "the noise kernel declined"
        return out

    gb = numel * 4 / 1e9
    for name, fn, traffic in (("torch", torch_path, 4 * gb), ("kernel", kernel_path, 2 * gb)):
        ms = timed_us(fn, reps=10) / 1000
        print(
            f"{name}: {ms:.2f} ms a step for {numel / 1e9:.3f} G fp32 elements "
            f"({traffic / ms * 1e3:.0f} GB/s of {traffic:.1f} GB moved), host {host_us(fn):.0f} us"
        )
    zeros = [torch.zeros_like(g) for g in grads[:9]]
    z = torch.cat([t.flatten() for t in noise_kernel.noised(zeros, gen, 0.0, 1.0)])
    print(
        f"kernel noise over {z.numel()} elements: mean {z.mean().item():.2e}, std "
        f"{z.std().item():.5f}, max |z| {z.abs().max().item():.2f}, "
        f"P(|z| > 4) {(z.abs() > 4).float().mean().item():.2e} (normal: 6.33e-05)"
    )


if __name__ == "__main__":
    main()
