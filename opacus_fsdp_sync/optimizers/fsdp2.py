"""The DP optimizer for FSDP2: noise drawn for each rank's own shard only.

Opacus's FSDP optimizer draws, on every rank, noise of each parameter's *global* shape (plus a
global-size zeros tensor) and keeps the local slice: ``world_size`` times the Gaussian samples a
step needs, and a full-size temporary per parameter. This optimizer draws exactly the local
shard's noise, from a stream per shard (rank 0's seed mixed with the shard's key: its mesh, its
coordinates along the sharded mesh dimensions and the parameters the stream covers): every
coordinate of the global gradient gets one independent draw even when every rank was seeded
identically, and replicas of a shard (HSDP) draw the same noise. It
also skips the gradient copy when the step is not accumulated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from opacus.optimizers.fsdpoptimizer_fast_gradient_clipping import (
    FSDPOptimizerFastGradientClipping,
)
from torch.distributed.tensor import DTensor

from ..distributed._fsdp2_internals import swap_local
from ..distributed.tensor_parallel import noise_keys, tp_sharded
from ..randomness import shard_generators
from . import noise_prefetch as draws
from .noised_step import FlatNoiseStep, add_to_sum, noise_layout


class NoiseStreams:
    """One noise stream per noise-stream key of the parameters (one without tensor parallelism).

    Args:
        generator: The engine's generator (rank 0's draws seed every stream), or None for OS
            entropy.
        device: Where the noise is drawn.
        params: The trainable parameters, in the optimizer's order.
    """

    def __init__(self, generator, device: torch.device, params: list) -> None:
        keys = noise_keys(params)
        self.keys = list(dict.fromkeys(keys))  # first-seen order
        index = {k: i for i, k in enumerate(self.keys)}
        self.members = [[] for _ in self.keys]
        for i, k in enumerate(keys):
            self.members[index[k]].append(i)
        # each stream's seed names its key and the parameters it covers (indices and local
        # shapes): ranks share a stream only where they hold the same shards of the same ones
        shapes = [tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape) for p in params]
        seeds = [
            (k, tuple(idx), tuple(shapes[i] for i in idx))
            for k, idx in zip(self.keys, self.members)
        ]
        self.generators = shard_generators(generator, device, seeds)

    def draw(self, layout: tuple[tuple, ...], std: float) -> list[torch.Tensor]:
        """Noise for each entry of ``layout`` (one per parameter), each from its key's stream."""
        if len(self.generators) == 1:
            return draws.draw_flat_noise(layout, std, self.generators[0])
        out: list = [None] * len(layout)
        for gen, idx in zip(self.generators, self.members):
            for i, view in zip(idx, draws.draw_flat_noise(tuple(layout[i] for i in idx), std, gen)):
                out[i] = view
        return out


class ShardedNoiseFSDPOptimizer(FlatNoiseStep, FSDPOptimizerFastGradientClipping):
    """``FSDPOptimizerFastGradientClipping`` with shard-local noise (not for ``secure_mode``).

    Gradients cleared to None count as zeros (``accepts_none_grads``). ``dp_degree`` (the
    :class:`~..distributed.layout.Layout`'s) is the number of ranks FSDP2 averaged the
    gradients over; the world size when None.

    Raises:
        ValueError: with ``secure_mode=True`` (keep Opacus's optimizer there).
    """

    #: The engine may clear gradients to None between passes: :meth:`accumulate` reads None as 0.
    accepts_none_grads = True

    def __init__(self, optimizer, *, generator=None, secure_mode=False, dp_degree=None, **kwargs):
        if secure_mode:
            raise ValueError("ShardedNoiseFSDPOptimizer does not implement secure_mode noise")
        super().__init__(optimizer, generator=None, secure_mode=False, **kwargs)
        if dp_degree is not None:  # FSDP2 averages over the data-parallel ranks only (tp)
            self.world_size = dp_degree
        plain = [tuple(p.shape) for p in self.params if not isinstance(p, DTensor)]
        tp_alone = any(tp_sharded(p) for p in self.params)  # FSDP2 leaves no plain parameter
        if plain and dist.get_world_size() > 1 and not tp_alone:
            raise ValueError(
                f"{len(plain)} trainable parameter(s) (shapes {plain[:3]}) are not managed by "
                "FSDP2; each rank would add its own noise and the replicas would drift apart. "
                "Shard every trainable parameter (fully_shard on the root) or freeze them."
            )
        self._seed_streams(generator)
        self._decide_noise_path([self._local(p) for p in self.params])

    def _seed_streams(self, generator) -> None:
        device = self.params[0].device if self.params else torch.device("cpu")
        self.streams = NoiseStreams(generator, device, list(self.params))
        #: The first stream (the only one without tensor parallelism; a checkpoint keeps all).
        self.generator = self.streams.generators[0] if self.streams.generators else None

    def _draw_noise(self, layout: tuple[tuple, ...], std: float) -> list[torch.Tensor]:
        """Each parameter's noise from its key's stream (:class:`NoiseStreams`)."""
        return self.streams.draw(layout, std)

    def _noise_streams(self, count: int) -> list[tuple[object, list[int]]]:
        """Each key's generator and the parameters it covers (:class:`NoiseStreams`).

        ``count``, the number of gradients, is the number of parameters here.
        """
        return list(zip(self.streams.generators, self.streams.members))

    def reseed_noise(self) -> None:
        """Fresh per-shard streams from OS entropy (collective); noise drawn ahead is dropped."""
        self.drop_noise_ahead()
        self._seed_streams(None)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Like Opacus, without a copy when this step is not accumulated over several calls.

        Under ``no_grad`` (DTensor ops then skip their autograd wrappers).
        """
        keep = bool(self._check_skip_next_step(pop_next=False))
        for p, state in zip(*self._param_states()):
            # A parameter this step did not use has no gradient (the engine clears gradients to
            # None between passes): it counts as zeros and still gets its noise.
            state["summed_grad"] = add_to_sum(state["summed_grad"], p.grad, p, keep)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def _noise_layout(self) -> tuple[tuple, ...]:
        key = self._param_states_key()
        if self._layout_key != key:
            self._layout_key = key
            self._layout = noise_layout([self._local(p) for p in self.params])
        return self._layout

    @torch.no_grad()
    def add_noise(self) -> None:
        """``p.grad = factor * summed + noise`` on the local shards, in one pass.

        ``factor`` is what :meth:`scale_grad` would apply next (``1 / (expected batch x
        accumulated iterations)`` for a mean loss; ``world_size`` for a sum, since FSDP averaged
        the gradients), so the scaling is done here and :meth:`scale_grad` does nothing.
        Works on the local tensors (no DTensor dispatch per parameter): one Gaussian draw per
        dtype and device for all shards together (prefetched during the backward), then
        ``noise += factor * summed`` (:mod:`.noised_step`) and each gradient DTensor takes its
        slice of the noise buffer as its local tensor. The summed gradient (a view of FSDP2's
        reduce-scatter output) is released here, not at ``zero_grad``: only one gradient-sized
        buffer is alive through the wrapped optimizer's step. (A single ``lerp`` is not used:
        with weight ``1 - 1/B`` in fp32 it mis-scales the gradient by up to ``B * 2^-25``
        relative, 1e-3 at B = 60 000.)
        """
        params, states = self._param_states()
        grads = []
        for p, state in zip(params, states):
            summed, state["summed_grad"] = state["summed_grad"], None
            if summed.shape != p.shape:
                summed = summed.view_as(p)
            if p.grad is not summed:
                p.grad = summed
            grads.append(summed)
        locals_ = [self._local(g) for g in grads]
        for p, grad, local, noised in zip(params, grads, locals_, self._noised(locals_)):
            if noised is local:
                continue
            if isinstance(grad, DTensor):
                swap_local(grad, noised)
            else:
                p.grad = noised


class DataParallelFSDPOptimizer(FSDPOptimizerFastGradientClipping):
    """Opacus's FSDP optimizer, its gradient divisor the data-parallel degree (tensor parallelism).

    Opacus divides by the world size; under FSDP2 x TP gradients were averaged over the
    ``dp_degree`` data-parallel ranks only (the :class:`~..distributed.layout.Layout`'s).
    """

    def __init__(self, optimizer, *, dp_degree: int, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.world_size = dp_degree
