"""Timers, the collective counter and phase markers shared by the engine, tests and harness."""

from .comm_counter import CollectiveCounter, CollectiveStats
from .phases import STEP_PHASES, current_phase, phase
from .timers import TIMING_ENV, StepTimer, timing_enabled_from_env

__all__ = [
    "STEP_PHASES",
    "TIMING_ENV",
    "CollectiveCounter",
    "CollectiveStats",
    "StepTimer",
    "current_phase",
    "phase",
    "timing_enabled_from_env",
]
