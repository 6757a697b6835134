"""Interpreter cases of the noise kernel (:mod:`opacus_fsdp_sync.optimizers.noise_kernel`).

Run by :mod:`tests.workers_kernels` under ``TRITON_INTERPRET=1``; each case turns the kernel on
for the CPU (``OPACUS_FSDP_SYNC_NOISE_KERNEL=1``) and restores the variable. The engine's step
with the kernel runs on FSDP2 and FSDP1 ranks in ``tests/test_noise_kernel.py``.
"""

from __future__ import annotations

import math
import os

import torch

from tests.workers_row_kernels import switched

#: Sizes around a program's block (the interpreter's 256): empty, one element, a partial last
#: block, an exact block, several blocks.
SHAPES = [(0, 4), (1,), (3, 85), (256,), (7, 300)]


def noise_kernel_on():
    """``OPACUS_FSDP_SYNC_NOISE_KERNEL=1`` within the block (yields the module)."""
    from opacus_fsdp_sync.optimizers import noise_kernel

    return switched(noise_kernel, "1")


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
        for _ in range(2):  # a key and a nonce per dtype group
            torch.randint(0, 2**62, (2,), generator=probe, dtype=torch.int64)
        assert torch.equal(gen.get_state(), probe.get_state())
    return "one seed per dtype group, drawn from the stream's generator"


def case_declines_and_failures():
    """Where the kernel declines (non-contiguous, subclass, fp64, no generator, setting 0): None
    (the caller draws with torch); a failed probe turns the device off, a failed launch raises
    (falling back on one rank could give replicas different noise)."""
    from opacus_fsdp_sync.layers.kernels import triton_noise
    from opacus_fsdp_sync.optimizers import noise_kernel

    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    with noise_kernel_on() as nk:
        assert nk.noised([torch.zeros(4, 6).t()], gen, 1.0, 1.0) is None
        assert nk.noised([torch.zeros(3).to(torch.float64)], gen, 1.0, 1.0) is None
        assert nk.noised([torch.nn.Parameter(torch.zeros(3))], gen, 1.0, 1.0) is None
        assert nk.noised([torch.zeros(3)], None, 1.0, 1.0) is None
        assert not nk.agree({cpu}, {torch.float64})
        original = triton_noise.noised
        probes = []

        def counted(*args, **kwargs):
            probes.append(args[0][0].dtype)
            return original(*args, **kwargs)

        triton_noise.noised = counted
        try:
            assert nk.agree({cpu}, {torch.float32, torch.bfloat16})
        finally:
            triton_noise.noised = original
        assert sorted(map(str, probes)) == ["torch.bfloat16", "torch.float32"], probes
        strided = torch.randn(4, 6, generator=gen).t()  # agreed: copied, not declined
        state = gen.get_state()
        (out,) = nk.noised_agreed([strided], gen, 1.0, 1.0)
        gen.set_state(state)
        (want,) = nk.noised_agreed([strided.contiguous()], gen, 1.0, 1.0)
        assert out.shape == strided.shape and torch.equal(out, want)
        two_devices = [torch.zeros(3), torch.zeros(2, device="meta")]
        for bad in ([torch.zeros(3).double()], two_devices):
            try:
                nk.noised_agreed(bad, gen, 1.0, 1.0)
            except ValueError as error:
                assert "make_private" in str(error), error
            else:
                raise AssertionError(f"agreed launch took {bad}")

        def broken(*args, **kwargs):
            raise RuntimeError("cannot compile here")

        triton_noise.noised = broken
        try:
            try:
                nk.noised([torch.zeros(3)], gen, 1.0, 1.0)
            except RuntimeError as error:
                assert "OPACUS_FSDP_SYNC_NOISE_KERNEL=0" in str(error), error
            else:
                raise AssertionError("a failed launch must raise")
            assert not nk.agree({cpu}, {torch.float32})  # the probe fails: off
        finally:
            triton_noise.noised = original
        assert cpu in noise_kernel._FAILED and not nk.wanted([cpu])
        noise_kernel._FAILED.clear()

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("no room for the probe")

        triton_noise.noised = out_of_memory
        try:
            assert not nk.agree({cpu}, {torch.float32})  # a vote, not a raise
        finally:
            triton_noise.noised = original
        assert cpu not in noise_kernel._FAILED  # memory may be free at the next vote
        noise_kernel._FAILED.clear()
        assert nk.noised([torch.zeros(3)], gen, 1.0, 1.0) is not None
    os.environ[noise_kernel.ENV] = "0"
    noise_kernel.refresh()
    try:
        assert noise_kernel.noised([torch.zeros(3)], gen, 1.0, 1.0) is None
        assert not noise_kernel.agree({cpu}, {torch.float32})
    finally:
        del os.environ[noise_kernel.ENV]
        noise_kernel.refresh()
    return (
        "declined: strided, fp64, subclass, no generator, setting 0 (agreed: strided copied); "
        "probe off, launch raises"
    )


def case_box_muller_extremes():
    """The largest draw (``x1 = 0``: ``u1 = 2^-33``, 6.7637) and ``u1 = 1`` (zero), by the
    kernel's own transform."""
    import triton
    import triton.language as tl

    from opacus_fsdp_sync.layers.kernels import triton_noise

    globals()["_normal_pair"] = triton_noise._normal_pair  # the kernel resolves names here

    @triton.jit
    def pairs(x1_ptr, x2_ptr, z0_ptr, z1_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        z0, z1 = _normal_pair(tl.load(x1_ptr + i), tl.load(x2_ptr + i))  # noqa: F821
        tl.store(z0_ptr + i, z0)
        tl.store(z1_ptr + i, z1)

    x1 = torch.tensor([0, 0, 2**32 - 1, 2**31], dtype=torch.int64).to(torch.uint32)
    x2 = torch.tensor([0, 2**30, 0, 2**30], dtype=torch.int64).to(torch.uint32)
    z0, z1 = torch.empty(4), torch.empty(4)
    pairs[(1,)](x1, x2, z0, z1, N=4)
    top = math.sqrt(-2 * math.log(2.0**-33))
    assert abs(z0[0].item() - top) < 1e-5 and abs(z1[0].item()) < 1e-5, (z0, z1)
    assert abs(z0[1].item()) < 1e-5 and abs(z1[1].item() - top) < 1e-5, (z0, z1)  # a quarter turn
    assert z0[2].item() == 0.0 and z1[2].item() == 0.0  # u1 rounds to 1
    r = math.sqrt(-2 * math.log(0.5))
    assert abs(z1[3].item() - r) < 1e-5, z1
    return f"largest draw {z0[0].item():.4f} (sqrt(2 ln 2^33) = {top:.4f})"


def case_key_and_nonce_both_count():
    """The same key with another nonce, and the same nonce with another key: other noise (the
    nonce reaches Philox's counter words)."""
    from opacus_fsdp_sync.layers.kernels import triton_noise

    block = triton_noise.INTERPRETER_BLOCK
    zeros = [torch.zeros(2 * block)]
    table = triton_noise.block_table([2 * block], block, torch.device("cpu"))

    def draw(key, nonce):
        seed = torch.tensor([key, nonce], dtype=torch.int64)
        return triton_noise.noised(zeros, table, seed, 0.0, 1.0, block)

    base = draw(12345, 777)
    assert torch.equal(base, draw(12345, 777))
    for other in (draw(12345, 778), draw(12346, 777), draw(12345, 777 + 2**32)):
        assert not torch.equal(base, other)
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1].item()) < 0.2
    return "key, nonce low and high words each change the noise"


CASES = {
    "noise_formula_bits": case_formula_bits,
    "noise_normal_distribution": case_normal_distribution,
    "noise_seeds_per_dtype": case_seeds_per_dtype_and_stream,
    "noise_declines_and_failures": case_declines_and_failures,
    "noise_box_muller_extremes": case_box_muller_extremes,
    "noise_key_and_nonce": case_key_and_nonce_both_count,
}
