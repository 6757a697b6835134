"""Moved: per-step norms live in :mod:`opacus_fsdp_sync.hooks.step_norms` (kept for old imports)."""

from .hooks.step_norms import NoNormsError, StepNormsMixin

__all__ = ["NoNormsError", "StepNormsMixin"]
