"""Interpreter cases of the noise kernel (:mod:`opacus_fsdp_sync.optimizers.noise_kernel`).

Run by :mod:`tests.workers_kernels` under ``TRITON_INTERPRET=1``; each case turns the kernel on
for the CPU (``OPACUS_FSDP_SYNC_NOISE_KERNEL=1``) and restores the variable. The engine's step
with the kernel runs on FSDP2 and FSDP1 ranks in ``tests/test_noise_kernel.py``.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

#: Sizes around a program's block (the interpreter's 256): empty, one element, a partial last
#: block, an exact block, several blocks.
SHAPES = [(0, 4), (1,), (3, 85), (256,), (7, 300)]


@contextlib.contextmanager
def noise_kernel_on():
    """``OPACUS_FSDP_SYNC_NOISE_KERNEL=1`` within the block."""
    from opacus_fsdp_sync.optimizers import noise_kernel

    old = os.environ.get(noise_kernel.ENV)
    os.environ[noise_kernel.ENV] = "1"
    noise_kernel.refresh()
    try:
        yield noise_kernel
    finally:
        if old is None:
            del os.environ[noise_kernel.ENV]
        else:
            os.environ[noise_kernel.ENV] = old
        noise_kernel.refresh()


def _zeros_noise(nk, grads, generator):
    """The kernel's noise for ``grads``' layout: the output for zero gradients at std 1."""
    return nk.noised([torch.zeros_like(g) for g in grads], generator, 0.0, 1.0)


def case_formula_bits():
    """``factor * g + std * z`` rounded once, bit for bit, for fp32, bf16 and fp16, at the
    block boundaries; the same generator state gives the same noise."""
    details = []
    with noise_kernel_on() as nk:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(3)
            grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
            state = gen.get_state()
            out = nk.noised(grads, gen, 0.125, 0.75)
            gen.set_state(state)
            z = nk.noised([torch.zeros_like(g, dtype=torch.float32) for g in grads], gen, 0, 1)
            assert out is not None and z is not None
            for o, g, n in zip(out, grads, z):
                assert o.shape == g.shape and o.dtype == dtype, (o.shape, o.dtype)
                want = (g.float() * 0.125 + n * 0.75).to(dtype)
                assert torch.equal(o.view(-1).float(), want.view(-1).float()), dtype
            details.append(str(dtype).removeprefix("torch."))
    return f"bit for bit: {', '.join(details)}; shapes {SHAPES}"


def case_normal_distribution():
    """The noise is N(0, 1): moments, tails, the largest draw, no repeated block, the four
    quarters of a program uncorrelated, and a new seed at every call."""
    from opacus_fsdp_sync.layers.kernels import triton_noise

    with noise_kernel_on() as nk:
        gen = torch.Generator().manual_seed(0)
        grads = [torch.zeros(32, 4096)]  # 512 programs of the interpreter's 256
        z = _zeros_noise(nk, grads, gen)[0].flatten().double()
        again = _zeros_noise(nk, grads, gen)[0].flatten().double()
    n = z.numel()
    assert abs(z.mean().item()) < 4 / math.sqrt(n), z.mean()
    assert abs(z.var().item() - 1) < 4 * math.sqrt(2 / n), z.var()
    tail = (z.abs() > 3).double().mean().item()  # normal: 2.70e-3
    assert abs(tail - 2.6998e-3) < 4 * math.sqrt(2.6998e-3 / n), tail
    assert z.abs().max().item() <= 6.77
    cdf = 0.5 * (1 + torch.erf(torch.sort(z).values / math.sqrt(2)))
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - cdf
    below = cdf - torch.arange(0, n, dtype=torch.float64) / n
    d = max(above.max().item(), below.max().item())
    assert d < 1.63 / math.sqrt(n), d  # Kolmogorov-Smirnov at 1 %
    blocks = z.view(-1, triton_noise.INTERPRETER_BLOCK)
    assert torch.unique(blocks, dim=0).shape[0] == blocks.shape[0]
    quarters = blocks.view(blocks.shape[0], 4, -1).transpose(0, 1).reshape(4, -1)
    corr = torch.corrcoef(quarters.float())
    assert (corr - torch.eye(4)).abs().max().item() < 0.02, corr
    assert abs(torch.corrcoef(torch.stack([z, again]).float())[0, 1].item()) < 0.02
    return f"{n} draws: mean {z.mean().item():.1e}, var {z.var().item():.4f}, KS {d:.1e}"


def case_seeds_per_dtype_and_stream():
    """Each dtype group draws its own seed: equal-sized fp32 and bf16 gradients get different
    noise; the generator advances by the seeds it gave."""
    with noise_kernel_on() as nk:
        gen = torch.Generator().manual_seed(1)
        grads = [torch.zeros(512), torch.zeros(512, dtype=torch.bfloat16)]
        a, b = _zeros_noise(nk, grads, gen)
        assert not torch.equal(a.bfloat16(), b)
        assert abs(torch.corrcoef(torch.stack([a, b.float()]))[0, 1].item()) < 0.2
        probe = torch.Generator().manual_seed(1)
        torch.randint(0, 2**62, (2,), generator=probe, dtype=torch.int64)
        assert torch.equal(gen.get_state(), probe.get_state())
    return "one seed per dtype group, drawn from the stream's generator"


def case_declines_and_failures():
    """Where the kernel declines (non-contiguous, subclass, no generator, setting 0) and a
    failed launch: None (the caller draws with torch), the device then keeps torch."""
    from opacus_fsdp_sync.layers.kernels import triton_noise
    from opacus_fsdp_sync.optimizers import noise_kernel

    gen = torch.Generator().manual_seed(0)
    with noise_kernel_on() as nk:
        assert nk.noised([torch.zeros(4, 6).t()], gen, 1.0, 1.0) is None
        assert nk.noised([torch.zeros(3).to(torch.float64)], gen, 1.0, 1.0) is None
        assert nk.noised([torch.nn.Parameter(torch.zeros(3))], gen, 1.0, 1.0) is None
        assert nk.noised([torch.zeros(3)], None, 1.0, 1.0) is None
        original = triton_noise.noised

        def broken(*args, **kwargs):
            raise RuntimeError("cannot compile here")

        triton_noise.noised = broken
        try:
            assert nk.noised([torch.zeros(3)], gen, 1.0, 1.0) is None
        finally:
            triton_noise.noised = original
        assert torch.device("cpu") in noise_kernel._FAILED
        assert nk.noised([torch.zeros(3)], gen, 1.0, 1.0) is None  # the device keeps torch
        noise_kernel._FAILED.clear()
        assert nk.noised([torch.zeros(3)], gen, 1.0, 1.0) is not None
    os.environ[noise_kernel.ENV] = "0"
    noise_kernel.refresh()
    try:
        assert noise_kernel.noised([torch.zeros(3)], gen, 1.0, 1.0) is None
    finally:
        del os.environ[noise_kernel.ENV]
        noise_kernel.refresh()
    return "declined: strided, fp64, subclass, no generator, setting 0; failure falls back"


CASES = {
    "noise_formula_bits": case_formula_bits,
    "noise_normal_distribution": case_normal_distribution,
    "noise_seeds_per_dtype": case_seeds_per_dtype_and_stream,
    "noise_declines_and_failures": case_declines_and_failures,
}
