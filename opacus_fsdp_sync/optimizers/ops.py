"""What the engine and the step may ask of any DP optimizer (``DPOptimizerOps``).

This package's optimizers implement the contract themselves; Opacus's get a small adapter that
has nothing to draw ahead, zero-fills cleared gradients, and restarts its noise from a fresh
generator.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from opacus.optimizers import DistributedDPOptimizer
from opacus.optimizers.ddp_perlayeroptimizer import DistributedPerLayerOptimizer
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping,
)
from opacus.optimizers.fsdpoptimizer_fast_gradient_clipping import (
    FSDPOptimizerFastGradientClipping,
)

from .noised_step import ScaledWithNoise


@runtime_checkable
class DPOptimizerOps(Protocol):
    """What the engine and the step may ask of a DP optimizer besides Opacus's own methods."""

    accepts_none_grads: bool
    """Gradients cleared to None between the passes count as zeros (and still get noise)."""

    def prefetch_noise(self) -> None:
        """Starts drawing the next step's noise now, to overlap the backward (or nothing)."""

    def reseed_noise(self) -> None:
        """Restarts every noise stream from OS entropy (collective), dropping draws ahead."""

    def settle_noise(self) -> None:
        """Waits for noise drawn ahead, keeping it (before the streams' state is read)."""

    def drop_noise_ahead(self) -> None:
        """Waits for noise drawn ahead and discards it (before the streams' state is set)."""


#: Opacus's optimizers whose ranks must share one noise stream (replicas stay equal).
_DISTRIBUTED = (
    DistributedDPOptimizer,
    DistributedPerLayerOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    FSDPOptimizerFastGradientClipping,
)


class OpacusOptimizerOps:
    """The contract for Opacus's own DP optimizers.

    Args:
        optimizer: An Opacus ``DPOptimizer``.
    """

    accepts_none_grads = False

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def prefetch_noise(self) -> None:
        """Nothing: Opacus draws its noise at step time."""

    def settle_noise(self) -> None:
        """Nothing: no noise is drawn ahead."""

    def drop_noise_ahead(self) -> None:
        """Nothing: no noise is drawn ahead."""

    def reseed_noise(self) -> None:
        """A fresh generator from OS entropy, the same on every rank (collective).

        Under ``secure_mode`` the optimizer draws from the OS CSPRNG and has no state: nothing
        to do.
        """
        from ..randomness import DPRandomness

        if self.optimizer.secure_mode:
            return
        params = self.optimizer.params
        device = params[0].device if params else torch.device("cpu")
        distributed = isinstance(self.optimizer, _DISTRIBUTED)
        self.optimizer.generator = DPRandomness().generator(
            "noise", device, distributed=distributed
        )


def optimizer_ops(optimizer) -> DPOptimizerOps:
    """``optimizer`` itself when it is one of this package's, else Opacus's adapter."""
    if isinstance(optimizer, ScaledWithNoise):
        return optimizer
    return OpacusOptimizerOps(optimizer)
