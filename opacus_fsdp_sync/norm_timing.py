"""Moved: norm timing lives in :mod:`opacus_fsdp_sync.tuning.timing` (kept for old imports)."""

from .tuning.timing import Candidate, candidate_timer

__all__ = ["Candidate", "candidate_timer"]
