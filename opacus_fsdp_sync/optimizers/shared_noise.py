"""A DP optimizer for DDP gradients that arrive averaged, with one noise draw for every rank.

With the activations-only first pass, the clipped gradients are averaged over ranks once before
``step()``: by the one-backward hand-off's bucketed all-reduce (the default), or by DDP's own in
the clipped second pass; either way each rank's ``p.grad`` is the average of the clipped sums.
Upstream's distributed optimizer would all-reduce every parameter again. This optimizer skips
that and adds, on every rank, the same Gaussian draw (rank 0's generator state is broadcast
once), scaled for the average: the step equals upstream's ``sum/(W b) + noise/(W b)`` and a
single process on the global batch with the same generator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from opacus.optimizers.optimizer import _generate_noise
from opacus.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping

from ..randomness import shared_generator
from .noised_step import ScaledWithNoise, add_scaled_into, add_to_sum, optimizer_noise_plan


class SharedNoiseDPOptimizer(ScaledWithNoise, DPOptimizerFastGradientClipping):
    """``DPOptimizerFastGradientClipping`` for gradients already averaged over DDP ranks.

    Args:
        optimizer: The wrapped optimizer.
        noise_multiplier: As in Opacus.
        max_grad_norm: As in Opacus.
        expected_batch_size: Per-rank expected batch size (as Opacus computes it under DDP).
        loss_reduction: ``"mean"`` or ``"sum"``.
        generator: Rank 0's generator; its state is broadcast so every rank draws the same
            noise. None seeds a fresh generator on rank 0.
        secure_mode: Must be False (a shared pseudo-random draw is not secure noise).
        **kwargs: Passed to Opacus.

    Raises:
        ValueError: with ``secure_mode=True``.
    """

    def __init__(
        self,
        optimizer,
        *,
        noise_multiplier,
        max_grad_norm,
        expected_batch_size,
        loss_reduction="mean",
        generator=None,
        secure_mode=False,
        **kwargs,
    ):
        if secure_mode:
            raise ValueError(
                "SharedNoiseDPOptimizer shares one pseudo-random draw across ranks and cannot run "
                "with secure_mode=True; use PrivacyEngine(restricted_first_pass=False) for DDP."
            )
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=None,
            secure_mode=False,
            **kwargs,
        )
        self.world_size = dist.get_world_size()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.generator = shared_generator(generator, device)

    def reseed_noise(self) -> None:
        """A fresh shared stream from OS entropy on rank 0 (collective); drops noise drawn ahead."""
        self.drop_noise_ahead()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.generator = shared_generator(None, device)

    def _ahead(self):
        """The pending draw (``(std, DrawAhead)`` here), or None."""
        return None if self._prefetched is None else self._prefetched[1]

    def _draw(self, std: float) -> list[torch.Tensor]:
        """One noise tensor per parameter, in parameter order (Opacus's own draw, at ``std``)."""
        return [
            _generate_noise(std=std, reference=p, generator=self.generator, secure_mode=False)
            for p in self.params
        ]

    @torch.no_grad()
    def accumulate(self) -> None:
        """Like Opacus, without its copy when this step is not accumulated over several calls."""
        keep = bool(self._check_skip_next_step(pop_next=False))
        for p in self.params:
            grad = None if p.grad is None else p.grad.detach()
            p.summed_grad = add_to_sum(p.summed_grad, grad, p, keep)

    def prefetch_noise(self) -> None:
        """Starts drawing the next step's noise now, to overlap the backward.

        A background thread on CPU, a side stream on CUDA; the same draws in the same order as
        at step time, so the shared noise is unchanged. A draw not yet consumed (a skipped step)
        is kept for the next real step.
        """
        if self._prefetched is not None or not self.params:
            return
        _, std = optimizer_noise_plan(self, 1)
        if std == 0:
            return
        from .noise_prefetch import DrawAhead

        self._prefetched = (std, DrawAhead(lambda: self._draw(std), self.params[0].device))

    @torch.no_grad()
    def add_noise(self) -> None:
        """``p.grad = summed / (b k) + noise / (W b k)`` (mean) or ``summed * W + noise`` (sum).

        The noise is the same on every rank (shared generator state), drawn already scaled
        during the backward when :meth:`prefetch_noise` was called; ``noise += factor *
        summed`` is one pass (:mod:`.noised_step`), so :meth:`scale_grad` has nothing left to do.
        """
        factor, std = optimizer_noise_plan(self, self.accumulated_iterations)
        pending, self._prefetched = self._prefetched, None
        noises = None
        if pending is not None:
            drawn_std, ahead = pending
            noises = ahead.result()  # always joined before the generator is used again
            if std == 0:
                noises = None
            elif std != drawn_std:
                noises = [n.mul_(std / drawn_std) for n in noises]
        summed = [p.summed_grad for p in self.params]
        self._scaled = True
        if std == 0:
            if factor != 1.0 and summed:
                torch._foreach_mul_(summed, factor)
            noises = summed
        else:
            if noises is None:
                noises = self._draw(std)
            add_scaled_into(noises, summed, factor)
        for p, g in zip(self.params, noises):
            p.grad = g.view_as(p)
            p.summed_grad = None  # not kept alive through the inner step
