"""Moved to :mod:`opacus_fsdp_sync.hooks.first_pass` (this name is kept for old imports)."""

from .hooks.first_pass import MissedHookError, PassTrackingMixin

__all__ = ["MissedHookError", "PassTrackingMixin"]
