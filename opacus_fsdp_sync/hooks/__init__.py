"""Our Opacus hook classes, the first-pass book-keeping around them, and what the step may call.

:mod:`.ghost` (the four classes for ``ghost`` / ``ghost_fsdp``), :mod:`.first_pass`,
:mod:`.step_norms`, :mod:`.replay` and :mod:`.tied` (the mixins they are made of). The layer
math is in :mod:`opacus_fsdp_sync.layers`.
"""

from .ghost import (
    GhostFSDPGradSampleHooks,
    GhostFSDPGradSampleModule,
    GhostGradSampleHooks,
    GhostGradSampleModule,
    ghost_class,
)

__all__ = [
    "GhostFSDPGradSampleHooks",
    "GhostFSDPGradSampleModule",
    "GhostGradSampleHooks",
    "GhostGradSampleModule",
    "ghost_class",
]
