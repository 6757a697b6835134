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

from .._opacus_internals import noise_multiplier_in_force
from ..randomness import shard_generator
from .noised_step import FlatNoiseStep, add_to_sum


class FSDP1DPOptimizer(FlatNoiseStep, FSDPOptimizerFastGradientClipping):
    """Opacus's FSDP optimizer for the parameters this rank holds a shard of.

    Noise comes from a per-rank stream (rank 0's seed mixed with the rank), so shards never
    repeat each other's draws even when every rank was seeded identically; with
    ``loss_reduction="sum"`` the averaged gradient is multiplied back by the world size. A held
    parameter this step did not use counts as zeros and still gets its noise. The step is one
    flat draw and one pass (:class:`~.noised_step.FlatNoiseStep`); from the second step on the
    draw runs during the backward (the held shards' sizes are known from the step before).
    """

    def __init__(self, optimizer, *, generator=None, secure_mode=False, **kwargs):
        super().__init__(optimizer, generator=generator, secure_mode=secure_mode, **kwargs)
        if not secure_mode:
            device = self.params[0].device if self.params else torch.device("cpu")
            self.generator = shard_generator(generator, device, (dist.get_rank(),))
            self._decide_noise_path(self.params)

    def reseed_noise(self) -> None:
        """Fresh per-rank streams from OS entropy (collective); secure noise has no stream."""
        if self.secure_mode:
            return
        self.drop_noise_ahead()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.generator = shard_generator(None, device, (dist.get_rank(),))

    def _owned(self) -> tuple[list, list[dict]]:
        """The held parameters and their ``grad_state`` entries.

        FSDP1 leaves the parameters this rank holds no part of with zero elements.
        """
        params, states = self._param_states()
        held = [i for i, p in enumerate(params) if p.numel() > 0]
        return [params[i] for i in held], [states[i] for i in held]

    @torch.no_grad()
    def accumulate(self) -> None:
        """Sums each held shard's gradient into ``summed_grad`` (a copy only when accumulating)."""
        keep = bool(self._check_skip_next_step(pop_next=False))
        for p, state in zip(*self._owned()):
            grad = None if p.grad is None else p.grad.detach()
            state["summed_grad"] = add_to_sum(state["summed_grad"], grad, p, keep)

    def _noise_layout(self) -> tuple[tuple, ...] | None:
        # Between forward and backward FSDP1 may hold the parameters unsharded: the held shards'
        # layout comes from the last step (None before the first, which draws at step time).
        # Secure noise is never drawn ahead.
        return None if self.secure_mode else self._drawn_layout

    @torch.no_grad()
    def add_noise(self) -> None:
        """``p.grad = factor * summed + noise`` on every held shard (one draw per coordinate)."""
        if self.secure_mode:
            return self._add_secure_noise()
        owned, states = self._owned()
        summed = [state["summed_grad"] for state in states]
        for state in states:
            state["summed_grad"] = None  # not kept alive through the inner step
        for p, noised in zip(owned, self._noised(summed)):
            p.grad = noised.view_as(p)

    def _add_secure_noise(self) -> None:
        """Opacus's secure draw and division per held shard (``scale_grad`` then does nothing)."""
        from opacus.optimizers.optimizer import _generate_noise

        for p, state in zip(*self._owned()):
            summed = state["summed_grad"]
            multiplier = noise_multiplier_in_force(self)
            noise = _generate_noise(
                std=multiplier * self.max_grad_norm,
                reference=summed,
                generator=self.generator,
                secure_mode=True,
            )
            if self.loss_reduction == "mean":
                noise.div_(self.world_size)
            else:  # FSDP averaged the gradients: the sum is world_size times that
                summed = summed * self.world_size
            p.grad = (summed + noise).view_as(p)
            if self.loss_reduction == "mean":  # Opacus's scale_grad, on the held shards only
                p.grad /= self.expected_batch_size * self.accumulated_iterations
        self._scaled = True
