"""bench.trace_phases: time per phase and op class from a profiler trace (CPU and device)."""

from __future__ import annotations

import json

import pytest
import torch

from opacus_fsdp_sync.bench import trace_phases
from opacus_fsdp_sync.profiling import StepTimer, profiler_ranges


def _profiled_step(tmp_path, ranges: bool):
    timer = StepTimer(enabled=True, log=False)
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiler_ranges() if ranges else torch.no_grad():
            with timer.phase("forward"):
                b = a @ a
            with timer.phase("first_backward"):
                c = b * 2.0
                with timer.phase("norms"):
                    c.sum(1)
    timer.flush()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return path


def test_cpu_trace_attributes_self_time_to_the_innermost_phase(tmp_path):
    times, kind = trace_phases.phase_times(trace_phases.load(_profiled_step(tmp_path, True)))
    assert kind == "cpu"
    assert times["forward"].by_class["matmul"] > 0
    assert times["first_backward"].by_class["elementwise"] > 0  # the mul
    assert times["norms"].by_class["reduction"] > 0  # the sum, in the inner phase only
    assert times["first_backward"].by_class["reduction"] == 0
    assert times["first_backward"].inner == pytest.approx(times["norms"].own)
    text = trace_phases.report(times, kind, "t")
    assert "| norms |" in text and "aten::sum" in text


def test_no_ranges_outside_profiler_ranges(tmp_path):
    events = trace_phases.load(_profiled_step(tmp_path, False))
    with pytest.raises(ValueError, match="profiler_ranges"):
        trace_phases.phase_times(events)


def _x(cat, name, ts, dur, tid=7, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}  # fmt: skip


def test_device_time_goes_to_the_phase_that_launched_it(tmp_path):
    """Kernels are attributed by their launch (correlation id) to the CPU range holding it, on
    any thread: the backward's launches come from autograd's thread, not the main one."""
    kernels = [  # (name, launch time on the CPU, device time)
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 5, 10),  # forward
        ("void at::native::vectorized_elementwise_kernel<4, mul>", 60, 5),  # first_backward
        ("void at::native::reduce_kernel<512, 1>", 72, 4),  # norms (autograd thread)
        ("_ghost_norm_kernel", 85, 8),  # norms, the second layer's range
        ("ncclDevKernel_ReduceScatter_Sum_bf16", 200, 6),  # after every range
    ]
    events = [
        _x("user_annotation", "phase::forward", 0, 50, tid=1),
        _x("user_annotation", "phase::first_backward", 50, 100, tid=1),
        _x("user_annotation", "phase::norms", 70, 10, tid=2),
        _x("user_annotation", "phase::norms", 82, 8, tid=2),
        _x("gpu_user_annotation", "phase::forward", 1000, 5000),  # GPU side: not used
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1500, 2, correlation=99),
        _x("cuda_runtime", "cudaMemcpyAsync", 61, 1, correlation=99),  # first_backward
        _x("cpu_op", "aten::mm", 1, 3),  # CPU ops are not device time
    ]
    for i, (name, launch, dur) in enumerate(kernels):
        events.append(_x("kernel", name, 1000 + 100 * i, dur, correlation=i))
        events.append(_x("cuda_runtime", "cudaLaunchKernel", launch, 1, tid=2, correlation=i))
    path = tmp_path / "t.json.gz"
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    times, kind = trace_phases.phase_times(trace_phases.load(path))
    assert kind == "device"
    assert dict(times["forward"].by_class) == {"matmul": 10}
    fb, norms = times["first_backward"], times["norms"]
    assert dict(fb.by_class) == {"elementwise": 5, "copy": 2}
    assert dict(norms.by_class) == {"reduction": 4, "matmul": 8}
    assert fb.inner == 12 and fb.own == 7
    assert dict(times["(outside)"].by_class) == {"collective": 6}
    out = tmp_path / "t.md"
    assert trace_phases.main([str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| first_backward | 0.0 | 0.0 |" in text and "_ghost_norm_kernel" in text


@pytest.mark.parametrize(
    ("name", "cat", "cls"),
    [
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>", "kernel", "matmul"),
        ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "kernel", "copy"),
        ("Memset (Device)", "gpu_memset", "copy"),
        ("aten::mul", "cpu_op", "elementwise"),
        ("aten::sum", "cpu_op", "reduction"),
        ("c10d::allreduce_", "cpu_op", "collective"),
    ],
)
def test_op_class_from_names(name, cat, cls):
    assert trace_phases.op_class(name, cat) == cls
