"""Moved (this name is kept for old imports).

``Linear`` per-sample gradients live in :mod:`opacus_fsdp_sync.layers.linear`, the rule choosing
them in :mod:`opacus_fsdp_sync.layers.linear_policy`.
"""

from ..layers.linear import clipped_sum, linear_per_sample_grads, per_sample_norms
from ..layers.linear_policy import PerSampleGradPolicy, machine_balance

__all__ = [
    "PerSampleGradPolicy",
    "clipped_sum",
    "linear_per_sample_grads",
    "machine_balance",
    "per_sample_norms",
]
