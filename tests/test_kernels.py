"""Fused Linear kernels: the custom ops against the torch path, their FLOPs, and the fallback.

The kernels themselves run under Triton's CPU interpreter in one subprocess started with
``TRITON_INTERPRET=1`` (:mod:`tests.workers_kernels`), skipped when triton is not installed
(``pip install -e .[kernels-test]``). Without triton (or without the interpreter) the ops take
the torch path: the tests here check that path, the FLOP formulas, the fake impls and that the
package falls back cleanly.
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers.kernels import availability, ops
from opacus_fsdp_sync.layers.linear_grams import contract_output_grams, upper_gram
from opacus_fsdp_sync.options import GhostOptions
from opacus_fsdp_sync.profiling import PhaseFlopCounter
from tests import workers_kernels

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Older interpreters fail on loops with a runtime bound (triton 3.5 under numpy 2.4).
MIN_INTERPRETER = (3, 9)


def _triton_version() -> tuple[int, ...]:
    version = importlib.metadata.version("triton").split("+")[0]
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install -e .[kernels-test])")
    if _triton_version() < MIN_INTERPRETER:
        pytest.skip(f"triton {_triton_version()}: interpreters before 3.9 fail on runtime loops")
    out = tmp_path_factory.mktemp("kernels") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tests.workers_kernels", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(workers_kernels.CASES))
def test_kernel_under_the_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    print(f"{case}: {result['detail']}")
    assert result["ok"], result["detail"]


def _inputs(n=2, t=37, d_in=21, d_out=45, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, t, d_in, generator=gen).to(dtype),
        torch.randn(n, t, d_out, generator=gen).to(dtype),
    )


def test_ops_take_the_torch_path_where_triton_cannot_launch():
    """CPU without the interpreter (and fp64 anywhere): the ops equal the torch path."""
    assert not availability.can_launch(torch.zeros(1)) or availability.interpreting()
    a, g = _inputs(dtype=torch.float64)
    want = (torch.bmm(g.mT, a) ** 2).sum((1, 2))
    torch.testing.assert_close(ops.ghost_norm_linear(a, g, 16), want)
    torch.testing.assert_close(ops.per_sample_norm_linear(a, g), want)
    coef = torch.tensor([0.25, 2.0])
    grad = ops.clipped_grad_linear(a, g, coef)
    torch.testing.assert_close(grad, torch.einsum("n,nto,nti->oi", coef.double(), g, a))


def test_flop_formulas_price_the_ops_as_the_torch_path(monkeypatch):
    from opacus_fsdp_sync.layers import linear_grams

    # the kernels' device's torch path: Grams contracted by batched dots (CPU: products)
    monkeypatch.setattr(linear_grams, "PRODUCT_CONTRACTION", set())
    a, g = _inputs()
    for block in (16, 64):
        with FlopCounterMode(display=False) as op_count:
            ops.ghost_norm_linear(a, g, block)
        with FlopCounterMode(display=False) as torch_count:
            contract_output_grams(upper_gram(a, block), g, block, bias=False)
        # both contract each tile element once
        assert op_count.get_total_flops() == torch_count.get_total_flops() > 0
    # One tile covering T: the full Grams' 2 N T^2 (d_in + d_out), and their contraction.
    assert ops.ghost_norm_flops(2, 37, 21, 45, 64) == 2 * 2 * 37**2 * (21 + 45 + 1)
    gemm = 2 * 2 * 37 * 21 * 45
    counter = PhaseFlopCounter()
    with counter:
        ops.per_sample_norm_linear(a, g)
        ops.clipped_grad_linear(a, g, torch.ones(2))
    assert sum(counter.flops.values()) == 2 * gemm
    with FlopCounterMode(display=False) as bmm_count:
        torch.bmm(g.mT, a)
    assert bmm_count.get_total_flops() == gemm


def test_fake_impls_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, g = torch.empty(3, 40, 8, dtype=torch.bfloat16), torch.empty(3, 40, 12).bfloat16()
        assert ops.ghost_norm_linear(a, g, 16).shape == (3,)
        assert ops.ghost_norm_linear(a, g, 16).dtype == torch.float32
        assert ops.per_sample_norm_linear(a, g).dtype == torch.float32
        grad = ops.clipped_grad_linear(a, g, torch.ones(3))
        assert grad.shape == (12, 8) and grad.dtype == torch.bfloat16


def test_empty_batch_on_the_torch_path():
    a, g = _inputs(n=0)
    assert ops.ghost_norm_linear(a, g, 16).shape == (0,)
    assert ops.per_sample_norm_linear(a, g).shape == (0,)
    assert not ops.clipped_grad_linear(a, g, torch.ones(0)).any()


def test_automatic_choice_is_the_torch_path(monkeypatch):
    a, g = _inputs()
    assert not availability.use_fused(None, a, g)
    assert not availability.use_fused(False, a, g)
    assert not availability.use_fused(True, a.double(), g.double())
    assert "torch path" in availability.describe(None, torch.device("cpu"))
    # None is the torch path on CUDA too (measured faster on an H100), and under the
    # interpreter, where only True launches the kernels
    assert availability.describe(None, torch.device("cuda")) == availability.AUTOMATIC
    assert "fused_kernels=True" in availability.AUTOMATIC
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not availability.use_fused(None, a, g)


def test_option_is_validated():
    assert GhostOptions().fused_kernels is None
    assert GhostOptions(sync_optimization=False).effective.fused_kernels is False
    with pytest.raises(ValueError, match="fused_kernels"):
        GhostOptions(fused_kernels="auto")
    PrivacyEngine(fused_kernels=False)


def test_package_falls_back_without_triton():
    """With triton made unimportable, the package imports, the ops run and True is refused."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, opacus_fsdp_sync\n"
        "from opacus_fsdp_sync.layers.kernels import availability, ops\n"
        "assert not availability.triton_available()\n"
        "a = torch.randn(2, 5, 3); g = torch.randn(2, 5, 4)\n"
        "assert not availability.use_fused(True, a, g)\n"
        "ops.ghost_norm_linear(a, g, 16); ops.clipped_grad_linear(a, g, torch.ones(2))\n"
        "try:\n"
        "    availability.describe(True, torch.device('cpu'))\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: fused_kernels=True needs triton" in done.stdout


def test_make_private_refuses_fused_kernels_without_triton_before_wrapping(monkeypatch):
    """fused_kernels=True where triton does not import: refused before any hook is attached."""
    from tests.private import make_private

    monkeypatch.setattr(availability, "triton_available", lambda: False)
    model = nn.Linear(4, 2)
    data = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    with pytest.raises(ValueError, match="fused_kernels=True needs triton"):
        make_private(PrivacyEngine(fused_kernels=True), model, data, 4, 1.0, "ghost")
    assert not model._forward_hooks and not model._backward_hooks


def test_linear_room_keeps_the_torch_path_when_off():
    from opacus_fsdp_sync.layers import room_for

    layer = nn.Linear(21, 45)
    a, g = _inputs()
    room = room_for(layer, nn.Linear)
    assert room.clipped_grad_folded(layer, [a], g, torch.ones(2), False) is None
    assert room.clipped_grad_folded(layer, [a], g, torch.ones(2), None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 300, 200, 350), (2, 130, 64, 5000), (1, 64, 128, 96)])
def test_compiled_kernels_on_cuda(dtype, shape):
    """The compiled kernels against fp64 on the same inputs (partial tiles, a wide head)."""
    n, t, d_in, d_out = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, t, d_in, device="cuda", generator=gen).to(dtype)
    g = torch.randn(n, t, d_out, device="cuda", generator=gen).to(dtype)
    exact = (torch.bmm(g.double().mT, a.double()) ** 2).sum((1, 2))
    # fp32 accumulation's error bound scales with the sum of the terms' magnitudes, which for
    # both orders of summation is the norm of |G|^T |A| (a bf16 case at T = 130 and d_out = 5000
    # was 1.6e-5 from fp64 relative to the norm itself, where positive and negative terms cancel)
    mag = (torch.bmm(g.double().abs().mT, a.double().abs()) ** 2).sum((1, 2))
    for got in (ops.ghost_norm_linear(a, g, 64), ops.per_sample_norm_linear(a, g)):
        assert got.dtype == torch.float32
        assert ((got.double() - exact).abs() / mag).max().item() <= 1e-5
    coef = torch.rand(n, device="cuda", generator=gen)
    scaled = torch.mul(g, coef.view(-1, 1, 1), out=torch.empty_like(g)).double()
    want = scaled.reshape(-1, d_out).t() @ a.double().reshape(-1, d_in)
    mag = scaled.abs().reshape(-1, d_out).t() @ a.double().abs().reshape(-1, d_in)
    got = ops.clipped_grad_linear(a, g, coef)
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert got.dtype == dtype
    assert (((got.double() - want).abs() - ulp * want.abs()) / mag).max().item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_kernels_on_cuda(dtype, monkeypatch):
    """The compiled row kernels: scaling bit for bit torch's (special values and subnormals
    too); dots within fp32 rounding of fp64."""
    from opacus_fsdp_sync.layers import linear_grams
    from opacus_fsdp_sync.layers.kernels import rows
    from opacus_fsdp_sync.layers.registry import scale_rows
    from tests.workers_row_kernels import bits, special_rows

    def use(value):
        monkeypatch.setenv(rows.ENV, value)
        monkeypatch.setattr(rows._SWITCH, "value", None)  # read again on the next call

    def both(fn, *args):
        """``fn`` with the kernels on every size (not auto's), then with the torch ops."""
        use("1")
        got = fn(*args)
        use("0")
        want = fn(*args)
        use("1")
        return got, want

    monkeypatch.setattr(rows, "_FAILED", set())  # a failed launch would answer with torch's ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    t_special, s_special = special_rows()
    subnormal = torch.tensor([[1e-40, -3e-41, 5e-39, 1.0], [1e-40, 2e-45, 1e-5, 0.0]])
    cases = [
        (torch.randn(*shape, device="cuda", generator=gen).to(dtype) * 300,
         torch.rand(shape[0], device="cuda", generator=gen) * 300)
        for shape in [(3, 300, 200), (8, 1024, 2048), (1, 7, 5)]
    ] + [
        (t_special.cuda().to(dtype), s_special.cuda()),
        (subnormal.cuda().to(dtype), torch.tensor([float("inf"), 1e-3], device="cuda")),
    ]  # fmt: skip
    for t, coef in cases:
        use("1")
        assert rows.scale_rows_kernel(t, coef, dtype) is not None  # the kernel runs
        for out in (torch.float32, torch.bfloat16, torch.float16):
            got, want = both(scale_rows, t, coef, out)
            assert got.dtype == want.dtype == out
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan), (t.shape, out)
            assert torch.equal(bits(got[~nan]), bits(want[~nan])), (t.shape, out)
    for shape in [(8, 1024, 1024), (8, 512, 1024), (3, 37, 41), (1, 1, 5)]:
        a = torch.randn(*shape, device="cuda", generator=gen)
        b = torch.randn(*shape, device="cuda", generator=gen)
        assert rows.batched_dot_kernel(a, b) is not None
        got, want = both(linear_grams.batched_dot, a, b)
        assert got.dtype == torch.float32
        exact = (a.double() * b.double()).flatten(1).sum(1)
        mag = (a.double().abs() * b.double().abs()).flatten(1).sum(1)
        assert ((got.double() - exact).abs() / mag).max().item() <= 1e-6
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert not rows._FAILED  # every launch ran
