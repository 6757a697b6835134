"""Interpreter cases of the row kernels (:mod:`opacus_fsdp_sync.layers.kernels.rows`).

Run by :mod:`tests.workers_kernels` under ``TRITON_INTERPRET=1``; each case turns the kernels on
for the CPU (``OPACUS_FSDP_SYNC_ROW_KERNELS=1``) and restores the variable.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def switched(module, value: str):
    """``module.ENV=value`` within the block, ``module.refresh()`` read on entry and exit."""
    old = os.environ.get(module.ENV)
    os.environ[module.ENV] = value
    module.refresh()
    try:
        yield module
    finally:
        if old is None:
            del os.environ[module.ENV]
        else:
            os.environ[module.ENV] = old
        module.refresh()


def row_kernels(value: str):
    """``OPACUS_FSDP_SYNC_ROW_KERNELS=value`` within the block."""
    from opacus_fsdp_sync.layers.kernels import rows

    return switched(rows, value)


@contextlib.contextmanager
def counted_launches():
    """Counts the launches of each row kernel that returned: ``{"scale_rows": n, ...}``.

    Also checks that no launch failed (a failure would have handed the call to torch's ops).
    """
    from opacus_fsdp_sync.layers.kernels import rows, triton_rows

    counts = {"scale_rows": 0, "batched_dot": 0}
    originals = {name: getattr(triton_rows, name) for name in counts}

    def wrap(name):
        def launch(*args, **kwargs):
            out = originals[name](*args, **kwargs)
            counts[name] += 1  # after it returned: a failed launch is not counted
            return out

        return launch

    for name in counts:
        setattr(triton_rows, name, wrap(name))
    failed_before = set(rows._FAILED)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(triton_rows, name, fn)
    assert rows._FAILED == failed_before, f"a row kernel failed on {rows._FAILED}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers (so -0.0 and +0.0 differ)."""
    return t.contiguous().view(_INT[t.element_size()])


def case_scale_rows_bits():
    """The kernel's rows equal torch's broadcast multiply bit for bit (every dtype pair,
    partial blocks, one sample, an empty batch, large values that overflow fp16)."""
    from opacus_fsdp_sync.layers.kernels import rows
    from opacus_fsdp_sync.layers.registry import scale_rows

    gen = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    checked = 0
    for src in dtypes:
        for dst in dtypes:
            for shape in [(3, 37, 21), (1, 5, 3), (0, 4, 4), (2, 130)]:
                t = (torch.randn(*shape, generator=gen) * 300).to(src)
                scale = torch.rand(shape[0], generator=gen) * 300
                with row_kernels("1"), counted_launches() as launches:
                    got = scale_rows(t, scale, dst)
                assert launches["scale_rows"] == 1, (src, dst, shape)
                with row_kernels("0"):
                    want = scale_rows(t, scale, dst)
                assert got.dtype == want.dtype == dst and got.shape == want.shape
                assert torch.equal(bits(got), bits(want)), (src, dst, shape)
                checked += 1
    fp64 = torch.randn(2, 3, dtype=torch.float64)
    with row_kernels("1"):
        assert rows.scale_rows_kernel(fp64, torch.ones(2), torch.float64) is None
        assert rows.scale_rows_kernel(torch.randn(3, 4).t(), torch.ones(4), torch.float32) is None
    return f"{checked} dtype and shape pairs bit for bit; fp64 and strided inputs declined"


def special_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows whose products are exact ties for bf16 and fp16, overflow, inf and NaN."""
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-11)]
    edges = [65520.0, -65520.0, 3.4e38, float("inf"), float("-inf"), float("nan")]
    t = torch.tensor([ties, edges, [0.0, -0.0, 1.5, 2.0, 0.0, float("inf")], [0.0] * 6])
    payloads = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, -0x007FFFFF], dtype=torch.int32)
    t[3, :4] = payloads.view(torch.float32)  # NaNs whose rounding carries into the sign bit
    scale = torch.tensor([1.0, 1.0, float("inf"), 1.0])  # inf x 0 is NaN, inf x -0 too
    return t, scale


def case_scale_rows_special_values():
    """Ties round to even, overflow goes to infinity, inf and NaN pass: torch's bits, for
    each output dtype (subnormals are left out: the interpreter flushes them)."""
    from opacus_fsdp_sync.layers.registry import scale_rows

    t, scale = special_rows()
    for dst in (torch.float32, torch.bfloat16, torch.float16):
        with row_kernels("1"), counted_launches() as launches:
            got = scale_rows(t, scale, dst)
        assert launches["scale_rows"] == 1
        with row_kernels("0"):
            want = scale_rows(t, scale, dst)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), dst
        assert torch.equal(bits(got[~nan]), bits(want[~nan])), (dst, got, want)
    return "ties, overflow, inf, signed zeros and NaN as torch computes them"


def case_batched_dot():
    """Gram-block dots from the kernel within fp32 rounding of fp64 and of the torch path."""
    from opacus_fsdp_sync.layers import linear_grams

    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for shape in [(3, 37, 41), (2, 1, 300), (1, 4, 1000), (0, 5, 5), (4, 9, 9)]:
        a, b = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
        with row_kernels("1"), counted_launches() as launches:
            got = linear_grams.batched_dot(a, b)
        assert launches["batched_dot"] == 1 and got.dtype == torch.float32, shape
        with row_kernels("0"):
            torch.testing.assert_close(got, linear_grams.batched_dot(a, b), rtol=1e-5, atol=1e-5)
        exact = (a.double() * b.double()).flatten(1).sum(1)
        mag = (a.double().abs() * b.double().abs()).flatten(1).sum(1).clamp(min=1e-30)
        err = ((got.double() - exact).abs() / mag).max().item() if exact.numel() else 0.0
        assert err <= 1e-6, (shape, err)
        worst = max(worst, err)
    return f"largest error {worst:.1e} of the sum of |terms|"


def seq_net_step_against_the_loop(engine, step) -> str:
    """One private step of :class:`tests.models.SharedInputSeqNet` against the
    clip-each-sample loop, with half the samples clipped.

    ``step(gsm, opt, crit, x, y)`` runs the step (forward, backward, ``opt.step()``). Asserts the
    parameters within 1e-6 of the loop's and an update that moved them.
    """
    from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
    from tests.models import SharedInputSeqNet, seq_sample_loss
    from tests.private import make_private

    b, t, d = 4, 10, 16
    torch.manual_seed(0)
    base = SharedInputSeqNet(d)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(b, t, d, generator=gen), torch.randint(0, 8, (b, t), generator=gen)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), seq_sample_loss, x, y, 1.0)
    clip = norms.median().item()  # half the samples clipped
    model = copy.deepcopy(base)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), b, clip, "ghost")
    step(gsm, opt, crit, x, y)
    assert engine.one_backward
    ref = copy.deepcopy(base)
    clip_each_sample_step(ref, seq_sample_loss, x, y, clip, 0.5)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    err = max((got[k] - want[k]).abs().max().item() for k in got)
    moved = max((got[k] - p).abs().max().item() for k, p in base.named_parameters())
    assert err <= 1e-6 and moved > 1e-3, (err, moved)
    return f"max parameter difference to the loop {err:.1e} (update {moved:.1e})"


def seq_loss(gsm, crit, x, y):
    """The sequence model's loss on ``(x, y)``."""
    logits = gsm(x)
    return crit(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=y.shape)


def case_engine_row_kernels():
    """A one-backward step with the row kernels on: the clip-each-sample loop's parameters."""
    from opacus_fsdp_sync import PrivacyEngine

    def step(gsm, opt, crit, x, y):
        with row_kernels("1"), counted_launches() as launches:
            seq_loss(gsm, crit, x, y).backward()
            opt.step()
        assert launches["scale_rows"] >= 5 and launches["batched_dot"] >= 6, launches
        counts.update(launches)

    counts: dict = {}
    engine = PrivacyEngine(per_sample_grads=False, tune_norms=False)
    detail = seq_net_step_against_the_loop(engine, step)
    return f"{detail}; launches {counts}"


CASES = {
    "rows_scale_bits": case_scale_rows_bits,
    "rows_scale_special_values": case_scale_rows_special_values,
    "rows_batched_dot": case_batched_dot,
    "rows_engine_step": case_engine_row_kernels,
}
