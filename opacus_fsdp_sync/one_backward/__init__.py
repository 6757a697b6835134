"""One backward per private step: clipped weight gradients straight from the first pass."""

from .step import (
    OneBackwardUnavailable,
    by_parameter,
    clipped_gradients,
    hand_to_single_device,
    unsupported_layers,
)

__all__ = [
    "OneBackwardUnavailable",
    "by_parameter",
    "clipped_gradients",
    "hand_to_single_device",
    "unsupported_layers",
]
