"""One room per layer type: its per-sample norm, per-sample gradient and clipped gradient.

Each module holds one layer type's three computations, from the same tensors, and registers
them by type (:mod:`.registry`): :mod:`.linear` (with its Gram blocks, :mod:`.linear_grams`, and
the per-sample-gradient rule, :mod:`.linear_policy`), :mod:`.embedding`, :mod:`.norms`
(``nn.LayerNorm`` and RMSNorm-like layers), :mod:`.generic` (exact replays of any other layer)
and :mod:`.tied` (weights shared between layers). Adding a layer type is adding a module that
registers a :class:`~.registry.LayerRoom` and importing it here.
"""

from . import embedding, generic, linear, norms, tied  # noqa: F401 - each registers its room
from .registry import (
    LayerRoom,
    Unavailable,
    norm_samplers,
    register_layer,
    room_for,
    room_named,
    rooms,
    typed_rooms,
    unregister_layer,
)

__all__ = [
    "LayerRoom",
    "Unavailable",
    "norm_samplers",
    "register_layer",
    "room_for",
    "room_named",
    "rooms",
    "typed_rooms",
    "unregister_layer",
]
