"""Moved (this name is kept for old imports).

Replays live in :mod:`opacus_fsdp_sync.layers.generic` (the generic room), the call recording in
:mod:`opacus_fsdp_sync.hooks.replay`.
"""

from .hooks.replay import ReplayMixin
from .layers.generic import (
    BATCHED_VJP_BYTES,
    ForwardCall,
    ReplayInputs,
    per_sample_grads,
    replay,
    replay_norm_sample,
)

__all__ = [
    "BATCHED_VJP_BYTES",
    "ForwardCall",
    "ReplayInputs",
    "ReplayMixin",
    "per_sample_grads",
    "replay",
    "replay_norm_sample",
]
