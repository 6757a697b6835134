"""The step timer's phases and the phase marker: nesting, exclusion, errors and profiler ranges."""

import time

import pytest
import torch

from opacus_fsdp_sync.profiling import timers
from opacus_fsdp_sync.profiling.phases import current_phase, phase
from opacus_fsdp_sync.profiling.timers import StepTimer, step_phase


def test_nested_phases_and_an_excluded_one_deducted_from_those_around_it():
    timer = StepTimer(enabled=True, log=False)
    with timer.phase("step"):
        with timer.phase("inner"):
            time.sleep(0.002)
        with timer.phase("tuning", excluded=True):
            time.sleep(0.02)
    out = timer.flush()
    assert out["tuning"] >= 20.0
    assert out["inner"] >= 2.0
    # "step" keeps the time of the phase inside it and loses the excluded one's
    assert out["inner"] <= out["step"] < out["inner"] + out["tuning"]


def test_a_phase_that_raises_is_still_recorded_and_the_error_passes():
    timer = StepTimer(enabled=True, log=False)
    with pytest.raises(ValueError, match="inside"):
        with timer.phase("broken"):
            raise ValueError("inside")
    assert "broken" in timer.flush()
    assert timer._open == []


def test_an_open_phase_cannot_be_entered_again():
    timer = StepTimer(enabled=True, log=False)
    span = timer.phase("once")
    with span:
        with pytest.raises(RuntimeError, match="already open"):
            span.__enter__()
    with span:  # closed again: reusable
        pass
    assert "once" in timer.flush()


def test_a_disabled_timer_records_nothing():
    timer = StepTimer(enabled=False, log=False)
    with timer.phase("x"):
        pass
    assert timer.flush() == {}


def test_profiler_ranges_open_outside_the_clock_and_close_once(monkeypatch):
    events = []

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(("open", self.name))

        def __exit__(self, *exc):
            events.append(("close", self.name))

    monkeypatch.setattr(torch.profiler, "record_function", Range)
    timer = StepTimer(enabled=True, log=False)
    with timers.profiler_ranges():
        with timer.phase("norms"):
            events.append(("body", None))
    with timer.phase("outside"):  # no range outside profiler_ranges()
        pass
    assert events == [("open", "phase::norms"), ("body", None), ("close", "phase::norms")]


def test_phase_marker_restores_the_outer_phase_even_on_error():
    assert current_phase() == "other"
    with phase("first_backward"):
        with pytest.raises(KeyError):
            with phase("norms"):
                assert current_phase() == "norms"
                raise KeyError("x")
        assert current_phase() == "first_backward"
    assert current_phase() == "other"


def test_step_phase_announces_and_times_and_undoes_both_on_error():
    timer = StepTimer(enabled=True, log=False)
    with pytest.raises(ValueError, match="inside"):
        with step_phase("norms", timer):
            assert current_phase() == "norms"
            assert timer._open == ["norms"]
            raise ValueError("inside")
    assert current_phase() == "other"
    assert timer._open == []
    assert "norms" in timer.flush()
    with step_phase("weight_grads"):  # no timer: announced only
        assert current_phase() == "weight_grads"
    assert current_phase() == "other"


def test_cpu_host_times_are_the_phase_times():
    timer = StepTimer(enabled=True, log=False)
    with timer.phase("step"):
        with timer.phase("tuning", excluded=True):
            time.sleep(0.002)
    assert timer.last_host_step == timer.flush()


def test_cuda_host_times_are_read_beside_the_events(monkeypatch):
    """On CUDA each phase also reads the host's clock: a phase the host leaves at once while its
    events span 100 ms of device time reports both, and exclusions apply to both."""

    class FakeEvent:  # a device clock that moves 50 ms at every record
        clock = 0.0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            FakeEvent.clock += 50.0
            self.t = FakeEvent.clock

        def synchronize(self):
            assert self.t is not None

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = StepTimer(enabled=True, device=torch.device("cuda"), log=False)
    assert timer.clock == "cuda_event"
    with timer.phase("step"):
        with timer.phase("busy"):
            time.sleep(0.03)
        with timer.phase("tuning", excluded=True):
            time.sleep(0.04)
    device, host = timer.flush(), timer.last_host_step
    assert device == {"busy": 50.0, "tuning": 50.0, "step": 250.0 - 50.0}
    assert host["busy"] >= 30.0 and host["tuning"] >= 40.0
    assert host["busy"] <= host["step"] < host["busy"] + 20.0  # tuning's 40 ms deducted


def test_cpu_stopwatch_separates_waiting_other_threads_and_own_work():
    """Sleeping is wall time only; a busy second thread is process time, not this thread's."""
    import threading

    from opacus_fsdp_sync.profiling import CpuStopwatch

    watch = CpuStopwatch()
    with pytest.raises(RuntimeError, match="before start"):
        watch.stop()
    watch.start()
    time.sleep(0.05)
    slept = watch.stop()
    assert slept.wall_ms >= 45 and slept.process_ms < 20 and slept.thread_ms < 20

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    watch.start()
    worker = threading.Thread(target=spin, args=(0.1,))
    worker.start()
    worker.join()
    other = watch.stop()
    assert other.process_ms >= 90 and other.thread_ms < other.process_ms - 50


def test_cpu_times_minus_a_busy_span_never_goes_below_zero():
    from opacus_fsdp_sync.profiling import CpuTimes

    times = CpuTimes(wall_ms=100.0, process_ms=80.0, thread_ms=5.0)
    assert times.minus(10.0) == CpuTimes(wall_ms=90.0, process_ms=70.0, thread_ms=0.0)
