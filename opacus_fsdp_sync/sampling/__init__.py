"""Poisson sampling that survives distributed training (see :mod:`.poisson`, :mod:`.memory`)."""

from . import memory
from .memory import EqualCountSplittingSampler
from .poisson import SharedPoissonDataLoader, SharedPoissonSampler, physical_batches, shared_seed

memory.install()

__all__ = [
    "EqualCountSplittingSampler",
    "SharedPoissonDataLoader",
    "SharedPoissonSampler",
    "physical_batches",
    "shared_seed",
]
