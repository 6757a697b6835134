"""Timers, the collective counter and phase markers shared by the engine, tests and harness."""

from .comm_counter import CollectiveCounter, CollectiveStats
from .cpu_time import CpuStopwatch, CpuTimes
from .flops import PhaseFlopCounter
from .memory import AllocatorWatch, allocator_counts, memory_summary, peak_memory, reset_peak
from .phases import PHASE_PARENT, STEP_PHASES, current_phase, phase
from .saved import SavedTensorsMeter
from .timers import TIMING_ENV, StepTimer, profiler_ranges, timing_enabled_from_env

__all__ = [
    "AllocatorWatch",
    "PHASE_PARENT",
    "STEP_PHASES",
    "TIMING_ENV",
    "CollectiveCounter",
    "CollectiveStats",
    "CpuStopwatch",
    "CpuTimes",
    "PhaseFlopCounter",
    "SavedTensorsMeter",
    "StepTimer",
    "allocator_counts",
    "current_phase",
    "memory_summary",
    "peak_memory",
    "reset_peak",
    "phase",
    "profiler_ranges",
    "timing_enabled_from_env",
]
