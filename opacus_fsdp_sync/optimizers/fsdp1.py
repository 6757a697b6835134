"""The DP optimizer for FSDP1 (``use_orig_params=True``) with sharded gradients.

After FSDP1's reduce-scatter each original parameter's ``.grad`` is the local shard of the
averaged gradient (``None`` where this rank holds no part of the parameter). Every coordinate is
owned by exactly one rank, which adds independent noise to it (divided by the world size, as
Opacus's FSDP optimizer does for the averaged mean).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from opacus.optimizers.fsdpoptimizer_fast_gradient_clipping import (
    FSDPOptimizerFastGradientClipping,
)

from .fsdp2 import shard_generator


class FSDP1DPOptimizer(FSDPOptimizerFastGradientClipping):
    """Opacus's FSDP optimizer, skipping parameters with no local shard.

    Noise comes from a per-rank stream (rank 0's seed mixed with the rank), so shards never
    repeat each other's draws even when every rank was seeded identically; with
    ``loss_reduction="sum"`` the averaged gradient is multiplied back by the world size.
    """

    def __init__(self, optimizer, *, generator=None, secure_mode=False, **kwargs):
        super().__init__(optimizer, generator=generator, secure_mode=secure_mode, **kwargs)
        if not secure_mode:
            device = self.params[0].device if self.params else torch.device("cpu")
            self.generator = shard_generator(generator, device, (dist.get_rank(),))

    def _owned(self):
        return [p for p in self.params if p.grad is not None and p.numel() > 0]

    def accumulate(self) -> None:
        """Sums each owned shard's gradient into ``summed_grad``."""
        for p in self._owned():
            state = self.grad_state[p]
            if state["summed_grad"] is not None:
                state["summed_grad"].add_(p.grad.data)
            else:
                state["summed_grad"] = p.grad.detach().clone()

    def add_noise(self) -> None:
        """Adds independent noise to every owned shard (once per coordinate overall)."""
        from opacus.optimizers.optimizer import _generate_noise

        for p in self._owned():
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=p.grad,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            summed = self.grad_state[p]["summed_grad"]
            if self.loss_reduction == "mean":
                noise.div_(self.world_size)
            else:  # FSDP averaged the gradients: the sum is world_size times that
                summed = summed * self.world_size
            p.grad = (summed + noise).view_as(p)

    def scale_grad(self) -> None:
        """Divides owned gradients by the expected batch size (mean reduction)."""
        if self.loss_reduction == "mean":
            for p in self._owned():
                p.grad /= self.expected_batch_size * self.accumulated_iterations
