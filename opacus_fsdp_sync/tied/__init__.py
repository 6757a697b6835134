"""Moved (this name is kept for old imports).

The tied-weight room lives in :mod:`opacus_fsdp_sync.layers.tied`, its hooks in
:mod:`opacus_fsdp_sync.hooks.tied`.
"""

from ..hooks.tied import TiedNormMixin
from ..layers.embedding import padding_aware_embedding_norm
from ..layers.tied import SharedParameter, UnsupportedTiedParameterError, find_shared_parameters

__all__ = [
    "SharedParameter",
    "UnsupportedTiedParameterError",
    "find_shared_parameters",
    "TiedNormMixin",
    "padding_aware_embedding_norm",
]
