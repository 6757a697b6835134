"""Bytes autograd saves for backward, to set the one-backward step's kept memory against.

The one-backward step holds each hooked layer's inputs and output gradient from the first pass
until the clipped gradients are computed (``PrivacyEngine.last_step_kept_bytes``). A forward
already saves tensors for backward (activations, softmax outputs, masks); this meter sums them
so the two can be reported side by side.
"""

from __future__ import annotations

import torch
from torch import nn


class SavedTensorsMeter:
    """Sums the distinct storages autograd saves inside the context (parameters excluded).

    Parameters are excluded because FSDP frees or reshards them independently of autograd.
    Views of one storage are counted once (by storage pointer, with the storage's size).

    Example::

        with SavedTensorsMeter() as meter:
            loss = model(x).sum()
        print(meter.bytes)
    """

    def __init__(self) -> None:
        self._seen: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved so far."""
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
            return t
        self._seen[(t.device, storage.data_ptr())] = storage.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
