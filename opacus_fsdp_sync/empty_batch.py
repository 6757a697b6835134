"""Empty physical batches for models that cannot run a batch of zero examples.

Under the shared Poisson draw a rank can have no example in a physical batch (a global draw
smaller than the world size, or an empty one) and must still run the forward and backward, so
that it joins every collective. Many models run a zero-size batch; Hugging Face's Llama attention
does not (it reshapes with ``-1``). For those, the forward of an empty batch runs instead on a
stand-in: the first example of the last non-empty batch this rank saw, whose per-sample loss the
criterion then multiplies by zero (before any non-empty batch: a synthetic example of the same
shape, ones for integer tensors and zeros for floating ones). Its gradient, per-sample norm and
clipped contribution are then exactly zero (zero times a finite number), and the rank's
collectives are the same as for a real example.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    return None


def _first(obj):
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        return obj[:1].detach().clone()
    return obj


def _synthetic(obj):
    """One example shaped like an empty batch's.

    Ones for integer and boolean tensors (a valid token id, an all-attending mask), zeros for
    floating ones.
    """
    if not (isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == 0):
        return obj
    fill = 0 if obj.is_floating_point() or obj.is_complex() else 1
    return torch.full((1, *obj.shape[1:]), fill, dtype=obj.dtype, device=obj.device)


class EmptyBatchStandIn:
    """Forward pre-hook state: swaps an empty batch for a zero-weighted stand-in example.

    Args:
        module: The model whose forward receives the batches (the user's model).
    """

    def __init__(self, module: nn.Module):
        self._example: tuple[tuple, dict] | None = None
        #: Set by the last forward when it ran on the stand-in; read and cleared by the loss.
        self.active = False
        self._handle = module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def _pre_forward(self, module, args, kwargs):
        size = _batch_size(args, kwargs)
        if size is None:
            return None
        if size > 0:
            self.active = False
            self._example = (
                tuple(_first(a) for a in args),
                {k: _first(v) for k, v in kwargs.items()},
            )
            return None
        self.active = True
        if self._example is None:  # no example seen yet: a synthetic one of the same shape
            logger.info("[Ghost] empty batch before any example on this rank: synthetic stand-in")
            return tuple(_synthetic(a) for a in args), {k: _synthetic(v) for k, v in kwargs.items()}
        args0, kwargs0 = self._example
        return args0, dict(kwargs0)

    def take(self) -> bool:
        """True once after a forward that ran on the stand-in (its loss must be weighted 0)."""
        active, self.active = self.active, False
        return active

    def remove(self) -> None:
        """Removes the hook."""
        self._handle.remove()
