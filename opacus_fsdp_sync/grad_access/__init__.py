"""Gradient access that works the same on FSDP2, FSDP1, DDP and a single device.

- :mod:`.microbatch`: where each API keeps unsynchronised gradients; :func:`microbatch` yields
  one microbatch's gradients alone; :func:`sync_disabled` turns sync off on any API.
- :mod:`.ops`: per-layer operations on synced gradients' local shards: norms (one all-reduce),
  freezing.
- :mod:`.snapshots`: copies of those shards, weighted combination, same-sign filtering.

Parameters are named as the user's model names them (wrapper prefixes removed), and layers by
module prefixes of those names (``"model.layers.3"``), the same on every API.
"""

from .microbatch import (
    MicrobatchGrads,
    clean_name,
    microbatch,
    sync_disabled,
    unsynced_grads,
)
from .ops import (
    GradNorms,
    freeze_outside,
    full_grads,
    layer_grad_norms,
    local_grads,
    select,
)
from .snapshots import GradSnapshot, add_grads, load_grads, same_sign_filter, save_grads

__all__ = [
    "GradNorms",
    "GradSnapshot",
    "MicrobatchGrads",
    "add_grads",
    "clean_name",
    "freeze_outside",
    "full_grads",
    "layer_grad_norms",
    "load_grads",
    "local_grads",
    "microbatch",
    "same_sign_filter",
    "save_grads",
    "select",
    "sync_disabled",
    "unsynced_grads",
]
