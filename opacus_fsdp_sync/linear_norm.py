"""Moved to :mod:`opacus_fsdp_sync.layers.linear` (this name is kept for old imports)."""

from .layers.linear import GramCache, make_linear_norm_sampler

__all__ = ["GramCache", "make_linear_norm_sampler"]
