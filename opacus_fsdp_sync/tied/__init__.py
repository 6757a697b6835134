"""Exact ghost-clipping norms for weights shared by several layers (tied embeddings)."""

from .detect import SharedParameter, UnsupportedTiedParameterError, find_shared_parameters
from .grad_sample import tied_class

__all__ = [
    "SharedParameter",
    "UnsupportedTiedParameterError",
    "find_shared_parameters",
    "tied_class",
]
