"""The row kernels' switch and where they decline (no Triton needed; the kernels themselves run
under the interpreter in ``test_kernels.py`` and on CUDA in its ``gpu`` tests)."""

import pytest
import torch

from opacus_fsdp_sync.layers import linear_grams
from opacus_fsdp_sync.layers.kernels import availability, rows
from opacus_fsdp_sync.layers.registry import scale_rows


@pytest.mark.parametrize(("value", "want"), [(None, "auto"), ("", "auto"), (" AUTO ", "auto"),
                                             ("0", "0"), ("1", "1")])  # fmt: skip
def test_setting_reads_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(rows.ENV, raising=False)
    else:
        monkeypatch.setenv(rows.ENV, value)
    assert rows.setting() == want


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(rows.ENV, "yes")
    with pytest.raises(ValueError, match="OPACUS_FSDP_SYNC_ROW_KERNELS='yes'.*auto.*0.*1"):
        scale_rows(torch.ones(2, 3), torch.ones(2))


def test_auto_keeps_cpu_tensors_on_the_torch_ops(monkeypatch):
    monkeypatch.delenv(rows.ENV, raising=False)
    t, scale = torch.randn(3, 4, 5), torch.rand(3)
    assert rows.scale_rows_kernel(t, scale, t.dtype) is None
    assert rows.batched_dot_kernel(t, t) is None


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(3, 4, dtype=torch.float64), torch.rand(3), torch.float64),  # fp64
        (torch.randn(4, 3).t(), torch.rand(3), torch.float32),  # strided
        (torch.randn(3, 4), torch.rand(3).double(), torch.float32),  # fp64 scale
        (torch.randn(3, 4), torch.rand(2), torch.float32),  # scale of another batch
        (torch.tensor(2.0), torch.rand(1), torch.float32),  # no rows
    ],
)
def test_scale_rows_declines_what_it_does_not_compute(monkeypatch, args):
    monkeypatch.setenv(rows.ENV, "1")  # on, wherever it can launch: still declined
    assert rows.scale_rows_kernel(*args) is None


def test_batched_dot_declines_what_it_does_not_compute(monkeypatch):
    monkeypatch.setenv(rows.ENV, "1")
    a = torch.randn(2, 3, 4)
    assert rows.batched_dot_kernel(a.bfloat16(), a.bfloat16()) is None
    assert rows.batched_dot_kernel(a, a[:1]) is None
    assert rows.batched_dot_kernel(a.transpose(1, 2), a.transpose(1, 2)) is None


def test_off_and_undecided_paths_give_torch_results(monkeypatch):
    """Where no kernel launches (off, or CPU without the interpreter) the torch ops answer."""
    t, scale = torch.randn(3, 4, 5).bfloat16(), torch.rand(3)
    want = torch.mul(t, scale.view(3, 1, 1), out=torch.empty_like(t))
    a = torch.randn(3, 4, 5)
    for value in ("0", "1"):
        monkeypatch.setenv(rows.ENV, value)
        if value == "1" and availability.can_launch(t):
            continue  # the interpreter is on: the kernels run (tested there)
        assert torch.equal(scale_rows(t, scale), want)
        torch.testing.assert_close(linear_grams.batched_dot(a, a), (a * a).sum((1, 2)))


@pytest.mark.parametrize(
    ("value", "device", "numel", "want"),
    [
        ("auto", "cuda", rows.SCALE_MIN_ELEMENTS, True),
        ("auto", "cuda", rows.SCALE_MIN_ELEMENTS - 1, False),  # the launch would cost more
        ("auto", "cpu", rows.SCALE_MIN_ELEMENTS, False),
        ("1", "cpu", 1, True),
        ("0", "cuda", rows.SCALE_MIN_ELEMENTS, False),
    ],
)
def test_auto_takes_cuda_tensors_from_a_size(monkeypatch, value, device, numel, want):
    monkeypatch.setenv(rows.ENV, value)
    assert rows.wanted(device, numel, rows.SCALE_MIN_ELEMENTS) is want
