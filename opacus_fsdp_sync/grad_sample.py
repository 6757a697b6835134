"""Moved: our Opacus hooks classes live in :mod:`opacus_fsdp_sync.hooks` (kept for old imports)."""

from .hooks.ghost import (
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
