"""The noise kernel (:mod:`opacus_fsdp_sync.optimizers.noise_kernel`): its switch, its
declines, and the DP step with it on, against the step's formula and the noise's distribution.

The kernel itself runs under Triton's CPU interpreter: in the kernel subprocess
(:mod:`tests.workers_noise_kernel`, through ``tests/test_kernels.py``) and here in spawned
gloo ranks started with ``TRITON_INTERPRET=1`` and ``OPACUS_FSDP_SYNC_NOISE_KERNEL=1``. The
CUDA test runs with ``-m gpu``.
"""

import importlib.util
import math

import pytest
import torch

from opacus_fsdp_sync.optimizers import noise_kernel
from opacus_fsdp_sync.testing import run_ranks
from tests import workers_noise

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def setting(monkeypatch):
    """``setting(value)``: ``OPACUS_FSDP_SYNC_NOISE_KERNEL=value`` for this test (None: unset)."""

    def use(value):
        if value is None:
            monkeypatch.delenv(noise_kernel.ENV, raising=False)
        else:
            monkeypatch.setenv(noise_kernel.ENV, value)
        noise_kernel._SWITCH.value = None  # read again on the next use

    yield use
    monkeypatch.undo()
    noise_kernel._SWITCH.value = None


def test_the_setting_is_validated_and_described(setting):
    setting("sometimes")
    with pytest.raises(ValueError, match="OPACUS_FSDP_SYNC_NOISE_KERNEL='sometimes'.*auto.*0.*1"):
        noise_kernel.describe()
    setting("off")
    assert "noise drawn by torch" in noise_kernel.describe()
    setting(None)
    phrase = noise_kernel.describe()
    assert noise_kernel.ENV in phrase
    assert ("on CUDA" in phrase) if HAS_TRITON else ("triton does not import" in phrase)


def test_auto_takes_cuda_only_and_off_declines_everything(setting):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    setting("auto")
    assert not noise_kernel.wanted([cpu])
    assert noise_kernel.wanted([cuda]) == HAS_TRITON
    assert not noise_kernel.wanted([cuda, cpu])
    assert not noise_kernel.wanted([])
    setting("0")
    assert not noise_kernel.wanted([cuda])


def test_the_cpu_without_the_interpreter_keeps_the_torch_path(setting):
    """``1`` on CPU outside the interpreter: nothing launches, the caller draws with torch."""
    setting("1")
    grads = [torch.randn(5, 3)]
    assert noise_kernel.noised(grads, torch.Generator().manual_seed(0), 0.5, 1.0) is None


def _kernel_ranks(monkeypatch, fn, *args):
    """``run_ranks(fn, 2, *args)`` in fresh interpreters with the kernel on under Triton's
    interpreter (fresh: the fork server imported its modules before these variables were set)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install -e .[kernels-test])")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(noise_kernel.ENV, "1")
    monkeypatch.setenv("OFS_RANKS_START", "spawn")
    return run_ranks(fn, 2, *args, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_kernel_noise_is_the_scaled_sum_plus_noise(monkeypatch, backend):
    """Step gradient = factor * summed + noise with the kernel drawing the noise (two steps,
    both ``zero_grad`` modes), against a run with the same seed and a zero loss."""
    worker = workers_noise.with_noise_kernel
    for res in _kernel_ranks(
        monkeypatch, worker, "noised_gradient_is_scaled_sum_plus_noise", backend
    ):
        # zero_grad's two modes x two runs (data, zero loss) x two steps, one stream each
        assert res["launches"] == 8 and not res["failed"], res
        for case in res["result"].values():
            assert case["grad"] > 1e-3 and case["noise"] > 1e-3, res
            assert case["err"] <= 4 * 2**-24 * (case["noise"] + case["grad"]), res
            assert case["fresh"], res  # step 1's noise is not step 0's


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_kernel_noise_is_independent_per_coordinate_with_the_right_scale(monkeypatch, backend):
    """Identically seeded ranks: N(0, 1) in units of sigma C / (W b) on every coordinate, no
    rank or half-parameter repeating another's draws."""
    worker = workers_noise.with_noise_kernel
    r0, r1 = _kernel_ranks(monkeypatch, worker, "noise_draws", "full", backend)
    # the noisy step (the noise-free one launches nothing)
    assert r0["launches"] == 1 and r1["launches"] == 1 and not r0["failed"], r0
    z = r0["result"]["noise"]
    n = z.numel()
    assert n > 20000
    assert abs(z.std().item() - 1.0) < 5 / math.sqrt(2 * n), z.std()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    a, b = r0["result"]["local"], r1["result"]["local"]
    k = min(a.numel(), b.numel())
    assert abs(torch.corrcoef(torch.stack([a[:k], b[:k]]))[0, 1].item()) < 0.05
    for name, t in r0["result"]["per_param"].items():
        rows = t.shape[0] // 2
        top, bottom = t[:rows].flatten(), t[rows : 2 * rows].flatten()
        assert not torch.equal(top, bottom), name
        if top.numel() >= 1000:
            assert abs(torch.corrcoef(torch.stack([top, bottom]))[0, 1].item()) < 0.1, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_kernel_on_cuda(dtype, setting):
    """The compiled kernel: the formula within one rounding of its own noise, N(0, 1) noise,
    fresh noise at every call, one seed per dtype."""
    setting("1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4099, 1027), (1,), (0, 3), (2048, 2048)]
    grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    state = gen.get_state()
    out = noise_kernel.noised(grads, gen, 0.25, 3.0)
    gen.set_state(state)
    z = noise_kernel.noised([torch.zeros_like(g) for g in grads], gen, 0.0, 1.0)
    assert out is not None and z is not None
    for o, g, n in zip(out, grads, z):
        assert o.shape == g.shape and o.dtype == dtype
        want = g.float() * 0.25 + n.float() * 3.0
        # bf16: the kernel adds its fp32 noise, the reference the noise rounded to bf16
        err = 2.0**-8 * (want.abs() + 3.0 * n.float().abs()) if dtype == torch.bfloat16 else 0
        assert ((o.float() - want).abs() <= 2 * 2.0**-23 * want.abs() + err + 1e-6).all()
    flat = torch.cat([t.float().flatten() for t in z])
    if dtype == torch.float32:
        count = flat.numel()
        assert abs(flat.mean().item()) < 5 / math.sqrt(count)
        assert abs(flat.std().item() - 1.0) < 5 / math.sqrt(count)
        assert flat.abs().max().item() <= 6.77
    again = noise_kernel.noised([torch.zeros_like(g) for g in grads], gen, 0.0, 1.0)
    assert not torch.equal(again[0], z[0])  # the generator moved on: a new seed


@pytest.mark.distributed
def test_replicas_of_a_shard_add_the_same_kernel_noise(monkeypatch):
    """``no_shard``: both ranks hold every coordinate and must add the same noise."""
    r0, r1 = _kernel_ranks(monkeypatch, workers_noise.with_noise_kernel, "noise_draws", "no_shard")
    assert r0["launches"] == 1 and r1["launches"] == 1, (r0["launches"], r1["launches"])
    assert torch.equal(r0["result"]["local"], r1["result"]["local"])
    assert abs(r0["result"]["noise"].std().item() - 1.0) < 0.05


@pytest.mark.distributed
def test_ranks_agree_on_the_noise_path(monkeypatch):
    """One rank asking for the kernel and one not: both draw with torch (replicas would
    otherwise add different noise); both asking: both take the kernel, and the checkpoint's
    layout record names it."""
    worker = workers_noise.noise_path_agreement
    for paths in _kernel_ranks(monkeypatch, worker, ["1", "0"]):
        assert paths == ["torch", "torch"], paths
    for paths in _kernel_ranks(monkeypatch, worker, ["1", "1"]):
        assert paths == [f"noise kernel {noise_kernel.VERSION} on cpu"] * 2, paths


def test_a_checkpoint_of_the_other_noise_path_is_refused():
    """The same generator state gives other noise on the other path: a layout difference
    (a checkpoint from before the kernel counts as the torch path)."""
    from opacus_fsdp_sync.sharding.dp_state import _layout_difference

    base = {"api": "fsdp2", "world_size": 2, "rank": 0, "optimizer": "X", "parameters": []}
    kernel = dict(base, noise_path="noise kernel v2 on cuda")
    difference = _layout_difference(dict(base, noise_path="torch"), kernel)
    assert difference is not None and "noise path" in difference, difference
    assert _layout_difference(base, kernel) is not None  # an older checkpoint: torch
    assert _layout_difference(base, dict(base, noise_path="torch")) is None
    assert _layout_difference(kernel, dict(kernel)) is None
    assert _layout_difference(dict(base, noise_path="noise kernel v1 on cuda"), kernel)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_noise_streams_with_the_kernel(monkeypatch):
    """TP alone (2 ranks, two noise streams: tp-sharded and tp-replicated coordinates) with the
    kernel: exact against the loop without noise; with noise, replicated coordinates get the
    same noise on both ranks, the sharded halves independent noise, at the right scale."""
    from tests import test_tp

    worker = workers_noise.with_noise_kernel
    ranks = _kernel_ranks(monkeypatch, worker, "tests.workers_tp:tensor_parallel", "tp_alone")
    # two noise streams x two noisy steps (the noise-free run launches nothing)
    assert all(r["launches"] == 4 and not r["failed"] for r in ranks), ranks
    results = [r["result"] for r in ranks]
    test_tp.test_exact_against_the_clip_each_sample_loop(("tp_alone", results))
    test_tp.test_noise_per_placement(("tp_alone", results))
