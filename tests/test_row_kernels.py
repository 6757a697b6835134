"""The row kernels' switch, where they decline, and their fallback (no Triton needed).

The launchers are replaced by a recording stand-in and ``can_launch`` is forced true, so each
test shows whether a call would reach a kernel. The kernels themselves run under the
interpreter in ``test_kernels.py`` (``tests/workers_row_kernels.py``) and on CUDA in its ``gpu``
tests.
"""

import logging

import pytest
import torch
from torch import nn

from opacus_fsdp_sync.layers import linear_grams
from opacus_fsdp_sync.layers.kernels import rows
from opacus_fsdp_sync.layers.registry import scale_rows


def set_row_kernels(monkeypatch, value: str | None) -> None:
    """Sets (None: unsets) the variable, and has the module read it again on its next call."""
    if value is None:
        monkeypatch.delenv(rows.ENV, raising=False)
    else:
        monkeypatch.setenv(rows.ENV, value)
    monkeypatch.setattr(rows._SWITCH, "value", None)  # restored with the variable after the test


class Launchers:
    """Stands in for :mod:`...triton_rows`: records calls, answers with the torch result."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def scale_rows(self, t, scale, dtype):
        self.calls.append("scale_rows")
        if self.fail:
            raise RuntimeError("no compiler here")
        shape = (t.shape[0],) + (1,) * (t.dim() - 1)
        return torch.mul(t, scale.view(shape), out=torch.empty(t.shape, dtype=dtype))

    def batched_dot(self, a, b):
        self.calls.append("batched_dot")
        if self.fail:
            raise RuntimeError("no compiler here")
        return (a * b).flatten(1).sum(1)


@pytest.fixture
def launchers(monkeypatch):
    """Kernels that 'launch' anywhere (recorded), with the setting on."""
    fake = Launchers()
    monkeypatch.setattr(rows, "_kernels", lambda: fake)
    monkeypatch.setattr(rows, "can_launch", lambda *tensors: True)
    monkeypatch.setattr(rows, "_FAILED", set())  # no device written off by an earlier test
    set_row_kernels(monkeypatch, "1")
    return fake


class Sub(torch.Tensor):
    """A tensor subclass, as a DTensor is: the kernels must not read its storage."""


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, "auto"), ("", "auto"), (" AUTO ", "auto"), ("0", "0"), ("off", "0"), ("no", "0"),
     ("1", "1"), ("True", "1"), ("on", "1"), ("yes", "1")],
)  # fmt: skip
def test_setting_reads_the_environment(monkeypatch, value, want):
    set_row_kernels(monkeypatch, value)
    assert rows.setting() == want


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    set_row_kernels(monkeypatch, "sometimes")
    with pytest.raises(ValueError, match="OPACUS_FSDP_SYNC_ROW_KERNELS='sometimes'.*auto.*0.*1"):
        scale_rows(torch.ones(2, 3), torch.ones(2))


def test_make_private_refuses_a_bad_setting_before_wrapping(monkeypatch):
    from opacus_fsdp_sync import PrivacyEngine
    from tests.private import make_private

    set_row_kernels(monkeypatch, "sometimes")
    model = nn.Linear(4, 2)
    data = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    with pytest.raises(ValueError, match=rows.ENV):
        make_private(PrivacyEngine(), model, data, 4, 1.0, "ghost")
    assert not model._forward_hooks and not model._backward_hooks  # nothing attached


def test_auto_keeps_cpu_tensors_on_the_torch_ops(launchers, monkeypatch):
    set_row_kernels(monkeypatch, "auto")
    t = torch.randn(2, rows.SCALE_MIN_ELEMENTS // 2)  # large enough, but on the CPU
    assert rows.scale_rows_kernel(t, torch.rand(2), t.dtype) is None
    assert rows.batched_dot_kernel(t, t) is None
    assert launchers.calls == []


def test_each_kernel_asks_with_its_own_size(launchers, monkeypatch):
    """Each caller passes its own ``auto`` size to :func:`rows.wanted`."""
    set_row_kernels(monkeypatch, "1")  # past the CPU's early exit, to wanted()
    sizes = []
    monkeypatch.setattr(rows, "wanted", lambda device, numel, minimum: sizes.append(minimum))
    t = torch.randn(2, 8)
    rows.scale_rows_kernel(t, torch.rand(2), t.dtype)
    rows.batched_dot_kernel(t, t)
    assert sizes == [rows.SCALE_MIN_ELEMENTS, rows.DOT_MIN_ELEMENTS]


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
def test_wanted_by_setting_device_and_size(monkeypatch, value, device, numel, want):
    set_row_kernels(monkeypatch, value)
    assert rows.wanted(device, numel, rows.SCALE_MIN_ELEMENTS) is want


def test_scale_rows_reaches_the_kernel_for_what_it_computes(launchers):
    for src in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 4, 5).to(src)
        got = scale_rows(t, torch.rand(3), torch.bfloat16)
        assert got.dtype == torch.bfloat16
    assert launchers.calls == ["scale_rows"] * 3


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(3, 4, dtype=torch.float64), torch.rand(3), torch.float64),  # fp64
        (torch.randn(3, 4), torch.rand(3), torch.float64),  # fp64 result
        (torch.randn(4, 3).t(), torch.rand(3), torch.float32),  # strided
        (torch.randn(3, 4), torch.rand(6)[::2], torch.float32),  # strided scale
        (torch.randn(3, 4), torch.rand(3).double(), torch.float32),  # fp64 scale
        (torch.randn(3, 4), torch.rand(2), torch.float32),  # scale of another batch
        (torch.tensor(2.0), torch.rand(1), torch.float32),  # no rows
        (torch.randn(3, 4, requires_grad=True), torch.rand(3), torch.float32),  # autograd
        (torch.randn(rows.MAX_ROWS + 1, 1), torch.rand(rows.MAX_ROWS + 1), torch.float32),
        (torch.randn(3, 4).as_subclass(Sub), torch.rand(3), torch.float32),  # subclass
        (torch.randn(3, 4), torch.rand(3).as_subclass(Sub), torch.float32),  # subclass scale
    ],
)
def test_scale_rows_declines_what_it_does_not_compute(launchers, args):
    assert rows.scale_rows_kernel(*args) is None
    assert launchers.calls == []


def test_batched_dot_reaches_the_kernel_or_declines(launchers):
    a = torch.randn(2, 3, 4)
    torch.testing.assert_close(linear_grams.batched_dot(a, a), (a * a).sum((1, 2)))
    assert launchers.calls == ["batched_dot"]
    for x, y in [
        (a.bfloat16(), a.bfloat16()),  # not fp32
        (a, a[:1]),  # shapes differ
        (a.transpose(1, 2), a.transpose(1, 2)),  # strided
        (a.as_subclass(Sub), a),  # subclass
        (a, a.as_subclass(Sub)),  # subclass second operand
        (a.clone().requires_grad_(), a),  # autograd
    ]:
        assert rows.batched_dot_kernel(x, y) is None
    assert launchers.calls == ["batched_dot"]


def test_a_failed_launch_falls_back_and_is_not_retried(monkeypatch, caplog):
    fake = Launchers(fail=True)
    monkeypatch.setattr(rows, "_kernels", lambda: fake)
    monkeypatch.setattr(rows, "can_launch", lambda *tensors: True)
    monkeypatch.setattr(rows, "_FAILED", set())
    set_row_kernels(monkeypatch, "1")
    t, scale = torch.randn(3, 4, 5).bfloat16(), torch.rand(3)
    want = torch.mul(t, scale.view(3, 1, 1), out=torch.empty_like(t))
    with caplog.at_level(logging.WARNING, logger=rows.__name__):
        assert torch.equal(scale_rows(t, scale), want)  # the torch op answered
        assert torch.equal(scale_rows(t, scale), want)
        a = torch.randn(2, 3)
        torch.testing.assert_close(linear_grams.batched_dot(a, a), (a * a).sum(1))
    assert fake.calls == ["scale_rows"]  # one try, then the device keeps the torch ops
    assert "row kernel scale_rows failed on cpu (RuntimeError: no compiler here)" in caplog.text


def test_out_of_memory_is_not_a_kernel_failure(monkeypatch):
    """An OOM propagates (torch's op would need the same memory) and writes nothing off."""

    def oom(*args):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(rows, "_kernels", lambda: type("K", (), {"scale_rows": staticmethod(oom)}))
    monkeypatch.setattr(rows, "can_launch", lambda *tensors: True)
    monkeypatch.setattr(rows, "_FAILED", set())
    set_row_kernels(monkeypatch, "1")
    with pytest.raises(torch.OutOfMemoryError):
        scale_rows(torch.randn(2, 3), torch.rand(2))
    assert not rows._FAILED


def test_off_gives_the_torch_ops(launchers, monkeypatch):
    set_row_kernels(monkeypatch, "0")
    t, scale = torch.randn(3, 4, 5).bfloat16(), torch.rand(3)
    want = torch.mul(t, scale.view(3, 1, 1), out=torch.empty_like(t))
    assert torch.equal(scale_rows(t, scale), want)
    a = torch.randn(3, 4, 5)
    torch.testing.assert_close(linear_grams.batched_dot(a, a), (a * a).sum((1, 2)))
    assert launchers.calls == []


def test_the_setting_is_read_once_until_refreshed(monkeypatch):
    set_row_kernels(monkeypatch, "0")
    assert rows.setting() == "0"
    monkeypatch.setenv(rows.ENV, "1")
    assert rows.setting() == "0"  # not read again at each call
    assert rows.refresh() == "1" and rows.setting() == "1"
    monkeypatch.setenv(rows.ENV, "0")
    rows.describe()  # make_private's call reads it again
    assert rows.setting() == "0"


def test_describe_names_the_setting(monkeypatch):
    monkeypatch.setattr(rows, "triton_available", lambda: True)
    for value, phrase in [("0", "off"), ("1", "wherever"), ("auto", "on CUDA tensors from")]:
        set_row_kernels(monkeypatch, value)
        assert phrase in rows.describe() and rows.ENV in rows.describe()
    monkeypatch.setattr(rows, "triton_available", lambda: False)
    assert "triton does not import" in rows.describe()
