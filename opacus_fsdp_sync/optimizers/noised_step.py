"""The scaled, noised gradient of a DP step, written in one pass over each gradient.

A DP step turns the summed clipped gradient ``s`` into ``factor * s + noise``: ``factor`` is
``1 / (expected batch x accumulated iterations)`` for a mean loss (what Opacus's ``scale_grad``
divides by) and ``world_size`` for a sum whose collective averaged; the noise's standard deviation
carries the same scaling. Opacus computes it in three or four passes (copy, add the noise, scale).
Here it is one pass: on the torch path the noise is drawn already scaled (during the backward
where possible) and ``noise += factor * s`` (one ``_foreach_add_``) reads the gradient and the
noise once and writes once, ``factor * s`` rounded as a separate scale would round it (a fused
multiply-add may round once), so the result is within one rounding of Opacus's; with the noise
kernel (:mod:`.noise_kernel`, CUDA) one kernel reads the gradient and writes ``factor * s +
noise``, drawing the noise inside. The gradient then points at the new buffer.
"""

from __future__ import annotations

import logging

import torch

from .._opacus_internals import noise_multiplier_in_force
from . import noise_kernel
from . import noise_prefetch as draws
from .noise_prefetch import NoisePrefetch, noise_layout

logger = logging.getLogger(__name__)


def noise_plan(
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    loss_reduction: str,
    expected_batch_size: int,
    world_size: int,
    accumulated: int,
) -> tuple[float, float]:
    """``(factor, std)``: ``p.grad = factor * summed + N(0, std^2)``, gradients averaged over ranks.

    Mean loss: ``factor = 1 / (b k)`` and ``std = sigma C / (W b k)`` (``b`` the expected batch
    per rank, ``k`` the accumulated iterations, ``W`` the world size): Opacus's
    ``(summed + noise / W) / (b k)``. Sum loss: the averaged gradient is multiplied back by ``W``
    and the noise is ``sigma C``.
    """
    std = noise_multiplier * max_grad_norm
    if loss_reduction == "mean":
        factor = 1.0 / (expected_batch_size * accumulated)
        return factor, std / world_size * factor
    return float(world_size), std


def optimizer_noise_plan(opt, accumulated: int) -> tuple[float, float]:
    """:func:`noise_plan` for an Opacus DP optimizer ``opt`` (its adjusted noise multiplier)."""
    return noise_plan(
        noise_multiplier=noise_multiplier_in_force(opt),
        max_grad_norm=opt.max_grad_norm,
        loss_reduction=opt.loss_reduction,
        expected_batch_size=opt.expected_batch_size,
        world_size=opt.world_size,
        accumulated=accumulated,
    )


def add_to_sum(
    summed: torch.Tensor | None, grad: torch.Tensor | None, param: torch.Tensor, keep: bool
) -> torch.Tensor:
    """The running sum of ``param``'s gradients after adding ``grad`` (None counts as zeros).

    The first gradient is taken as it is, without Opacus's copy, unless ``keep`` (the step will
    be skipped: the next micro-batch's backward writes into ``p.grad``, so the sum must not alias
    it). Later gradients are added in place.
    """
    grad = grad if grad is not None else torch.zeros_like(param)
    if summed is not None:
        return summed.add_(grad)
    return grad.clone() if keep else grad


def add_scaled_into(noises: list[torch.Tensor], grads: list[torch.Tensor], factor: float) -> None:
    """``noises[i] += factor * grads[i]`` for every ``i``, in one foreach pass."""
    if noises:
        torch._foreach_add_(noises, grads, alpha=factor)


class ScaledWithNoise:
    """Mixin: ``scale_grad`` does nothing after an ``add_noise`` that scaled (set ``_scaled``).

    The base of this package's DP optimizers, which implement the engine's whole optimizer
    contract (:class:`~opacus_fsdp_sync.apis.api.DPOptimizerOps`): draw noise ahead,
    read gradients cleared to None, restart the noise streams from fresh OS entropy.
    """

    #: Whether gradients cleared to None between the passes count as zeros.
    accepts_none_grads = False
    #: Set by an ``add_noise`` that scaled the gradients already (``scale_grad`` then skips).
    _scaled = False
    #: Noise drawn ahead for the next step (None: none pending).
    _prefetched = None

    def prefetch_noise(self) -> None:
        """Nothing by default (the noise is drawn at step time)."""

    def _ahead(self):
        """The pending draw's :class:`~.noise_prefetch.DrawAhead`, or None."""
        return None if self._prefetched is None else self._prefetched.ahead

    def settle_noise(self) -> None:
        """Waits for noise drawn ahead and keeps it for the step.

        The generators' state then includes the draw, whenever the drawing thread ran: a
        checkpoint saved now resumes after it (never drawing it again), and is not read while
        the thread is between two draws.
        """
        ahead = self._ahead()
        if ahead is not None:
            ahead.result()

    def drop_noise_ahead(self) -> None:
        """Waits for noise drawn ahead and discards it (before a generator's state is replaced).

        A draw kept across a state load would be added at the next step, and the loaded state
        would then draw it again one step later: the same noise twice.
        """
        ahead = self._ahead()
        self._prefetched = None
        if ahead is not None:
            ahead.result()

    def reseed_noise(self) -> None:
        """Restarts every noise stream from OS entropy, dropping noise drawn ahead.

        Collective (rank 0's seed is broadcast). A resume that must not continue the saved
        streams (``fresh_noise=True``) calls it.
        """
        raise NotImplementedError

    def scale_grad(self) -> None:
        """Nothing when ``add_noise`` scaled already (always, in a step); else Opacus's division."""
        if self._scaled:
            self._scaled = False
            return
        super().scale_grad()


class FlatNoiseStep(ScaledWithNoise):
    """Mixin for Opacus's FSDP optimizer: one flat noise draw per dtype and device, one pass.

    The subclass provides :meth:`_noise_layout` (the local gradients' shapes, dtypes and devices,
    known before the gradients, or None) and an ``add_noise`` that collects the local gradients
    and calls :meth:`_noised`. On the torch path the noise of the next step, already split into
    gradient-shaped views, is drawn during the backward (:meth:`prefetch_noise`, called by the
    engine; the same seed gives the same noise either way); with the noise kernel, decided once
    with every rank (:meth:`_decide_noise_path`, which the subclass calls at construction),
    nothing is drawn ahead.
    """

    #: Whether the noise kernel draws this optimizer's noise (:meth:`_decide_noise_path`).
    _noise_kernel = False

    #: Cache key of a subclass's :meth:`_noise_layout`; reset when a prefetched layout is stale.
    _layout_key = None
    #: The layout of the last step's noised gradients (None before the first noised step).
    _drawn_layout = None
    #: Cache key of :meth:`_param_states`.
    _states_key = None

    def _noise_layout(self) -> tuple[tuple, ...] | None:
        """:func:`noise_layout` of the next step's local gradients, or None if unknown."""
        raise NotImplementedError

    def _draw_noise(self, layout: tuple[tuple, ...], std: float) -> list[torch.Tensor]:
        """Noise for ``layout``: one flat draw per dtype and device from ``self.generator``."""
        return draws.draw_flat_noise(layout, std, self.generator)

    def _noise_streams(self, count: int) -> list[tuple[object, list[int]]]:
        """``[(generator, indices)]``: which of ``count`` gradients each noise stream covers."""
        return [(self.generator, list(range(count)))]

    def _decide_noise_path(self, params: list) -> None:
        """Decides, with every rank, whether the noise kernel draws the noise (collective).

        Replicas of a shard must add the same noise and the two paths' numbers differ, so the
        choice is made once for all ranks (:func:`.noise_kernel.agree`), from the devices and
        dtypes of ``params`` (the local shards, as the gradients will be), and logged.
        """
        self._noise_kernel = noise_kernel.agree(
            {p.device for p in params}, {p.dtype for p in params}
        )
        logger.info("[Ghost] noise: %s (agreed by every rank)", self.noise_path())

    def noise_path(self) -> str:
        """What draws this optimizer's noise: ``"torch"`` or the noise kernel, versioned.

        A checkpoint records it: the same generator state gives other noise on another path
        (:data:`.noise_kernel.VERSION` names the kernel's way of drawing).
        """
        if not self._noise_kernel:
            return "torch"
        return f"noise kernel {noise_kernel.VERSION} on {self.params[0].device.type}"

    def _kernel_noised(
        self, grads: list[torch.Tensor], factor: float, std: float
    ) -> list[torch.Tensor]:
        """``factor * g + noise`` by the noise kernel (:mod:`.noise_kernel`), on the agreed path.

        Nothing checked here can differ between replicas: every gradient is launched.
        """
        out: list = [None] * len(grads)
        for generator, idx in self._noise_streams(len(grads)):
            part = noise_kernel.noised_agreed([grads[i] for i in idx], generator, factor, std)
            for i, t in zip(idx, part):
                out[i] = t
        return out

    def _param_states_key(self, params: list | None = None) -> tuple:
        """Identifies the current trainable parameters (and Opacus's ``grad_state``)."""
        return (id(self.grad_state), *map(id, self.params if params is None else params))

    def _param_states(self) -> tuple[list, list[dict]]:
        """The trainable parameters and their ``grad_state`` entries (cached per parameter set).

        Saves a Python-level ``Tensor.__hash__`` per parameter and lookup, several per step.
        """
        params = self.params
        key = self._param_states_key(params)
        if self._states_key != key:
            self._states_key = key
            self._states = [self.grad_state[p] for p in params]
        return params, self._states

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus's ``zero_grad`` (drops the summed gradients unless the step was skipped)."""
        if not self._is_last_step_skipped:
            for state in self._param_states()[1]:
                state["summed_grad"] = None
        self.original_optimizer.zero_grad(set_to_none)

    def prefetch_noise(self) -> None:
        """Starts drawing the step's noise now, to overlap the rest of the backward.

        A background thread on CPU, a side stream on CUDA; :meth:`_noised` waits for it. Called
        by the engine after the first pass of every private backward, before the clipped
        gradients; a draw not yet consumed (a skipped or failed step) is kept for the next real
        step. Same seed, same noise as without it.
        """
        if self._prefetched is not None:
            return
        _, std = optimizer_noise_plan(self, 1)
        layout = self._noise_layout()
        if std == 0 or not layout or self._noise_kernel:
            return  # nothing to draw ahead (the noise kernel draws inside the add)
        self._prefetched = NoisePrefetch(layout, std, self._draw_noise)

    @torch.no_grad()
    def _noised(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``factor * g + noise`` for each local gradient ``g``; the results are new tensors.

        Views of one flat noise buffer per ``(dtype, device)``: written in one pass by the noise
        kernel when every rank agreed on it (:mod:`.noise_kernel`), else the prefetched draw
        (when the layout matches) with the gradients added into it by :func:`add_scaled_into`;
        without noise the gradients are scaled in place and returned. Sets the flag that makes
        ``scale_grad`` a no-op for this step.
        """
        factor, std = optimizer_noise_plan(self, self.accumulated_iterations)
        prefetched, self._prefetched = self._prefetched, None
        # Always joined (before the generator is used again), even when not used.
        drawn = prefetched.take(std if std else prefetched.std) if prefetched else None
        self._scaled = True
        if std == 0:
            if factor != 1.0 and grads:
                torch._foreach_mul_(grads, factor)
            return grads
        layout = self._drawn_layout = noise_layout(grads)
        if grads and self._noise_kernel:
            return self._kernel_noised(grads, factor, std)
        if drawn is None or prefetched.layout != layout:
            if drawn is not None:  # e.g. the model changed dtype: the cached layout is stale
                self._layout_key = None
            drawn = self._draw_noise(layout, std)
        add_scaled_into(drawn, grads, factor)
        return drawn
