"""Moved: the norm tuner lives in :mod:`opacus_fsdp_sync.tuning` (kept for old imports)."""

from .tuning import (
    NORM_PLAN_ENV,
    Candidate,
    Choice,
    NormKey,
    NormTuner,
    device_name,
    make_norm_tuner,
    sensible_blocks,
    tuning_wanted,
)

__all__ = [
    "NORM_PLAN_ENV",
    "Candidate",
    "Choice",
    "NormKey",
    "NormTuner",
    "device_name",
    "make_norm_tuner",
    "sensible_blocks",
    "tuning_wanted",
]
