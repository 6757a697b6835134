"""Timers, the collective counter and phase markers shared by the engine, tests and harness."""

import importlib

from .comm_counter import CollectiveCounter, CollectiveStats
from .flops import PhaseFlopCounter
from .memory import memory_summary, peak_memory, reset_peak
from .phases import PHASE_PARENT, STEP_PHASES, current_phase, phase
from .saved import SavedTensorsMeter
from .timers import TIMING_ENV, StepTimer, timing_enabled_from_env

__all__ = [
    "PHASE_PARENT",
    "STEP_PHASES",
    "TIMING_ENV",
    "CollectiveCounter",
    "CollectiveStats",
    "PhaseFlopCounter",
    "SavedTensorsMeter",
    "StepTimer",
    "current_phase",
    "memory_summary",
    "peak_memory",
    "reset_peak",
    "phase",
    "timing_enabled_from_env",
]


#: The profiling suite's modes moved to the benchmark part (:mod:`opacus_fsdp_sync.bench.modes`);
#: their old names here are forwarded on first access, so importing this package never loads it.
_MOVED_TO_BENCH = frozenset({"MODES", "ModeSpec", "get_mode"})


def __getattr__(name: str):
    """Forwards the moved names to the re-export shim :mod:`.modes`."""
    if name in _MOVED_TO_BENCH:
        return getattr(importlib.import_module(".modes", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
