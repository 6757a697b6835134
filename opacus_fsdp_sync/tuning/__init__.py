"""Choosing among the ``Linear`` room's exact norm strategies by measurement (``tune_norms``).

:mod:`.tuner` (the tuner, agreement across ranks), :mod:`.timing` (timing a strategy's work, as
the ``Linear`` room describes it), :mod:`.store` (keys, choices and the plan file).
"""

from ..layers.linear import Candidate
from .store import Choice, NormKey, device_name
from .tuner import NORM_PLAN_ENV, NormTuner, make_norm_tuner, sensible_blocks, tuning_wanted

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
