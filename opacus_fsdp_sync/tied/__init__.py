"""Exact ghost-clipping norms for weights shared by several layers (tied embeddings)."""

from .detect import SharedParameter, UnsupportedTiedParameterError, find_shared_parameters
from .grad_sample import TiedNormMixin, padding_aware_embedding_norm

__all__ = [
    "SharedParameter",
    "UnsupportedTiedParameterError",
    "find_shared_parameters",
    "TiedNormMixin",
    "padding_aware_embedding_norm",
]
