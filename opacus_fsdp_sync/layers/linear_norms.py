"""The ``Linear`` norm sampler: its route per layer, the shared input Grams, batched finishing.

:class:`LinearNormSampler` is the norm Opacus calls for an ``nn.Linear`` (its signature) when
fast norms are on. A layer's norm is routed first (:meth:`LinearNormSampler.route`): per-sample
gradients where the policy or the tuner takes them, the rank-one formula for one token per
sample, the fused kernels where they apply; otherwise a :class:`GramJob`, the Gram contraction
still to compute (:meth:`LinearNormSampler.finish`). Called as a function it does both at once.

The lean hook lanes defer a one-backward step's norms to the end of its first pass
(:meth:`~opacus_fsdp_sync.hooks.lean.LeanLaneMixin.finish_norms`). There
:meth:`LinearNormSampler.finish_batch` finishes the Gram jobs together: the layers that read one
input (``q``/``k``/``v``, ``gate``/``up``), each with one Gram block, fp32 or fp64, on a device
whose contractions multiply and sum (:data:`.linear_grams.PRODUCT_CONTRACTION`, CPU) write their
output-gradient Grams into one buffer and take one contraction with the input Gram, one
``clamp``/``sqrt`` and one scaling for all of them. Each row is the number the per-layer route
computes, bit for bit (``tests/test_lean_hooks.py`` and ``tests/test_linear_batched_norms.py``
compare them): a group is batched only where torch sums every row the way the per-layer
contraction does (:func:`_may_batch`), and within a memory bound. The batching only removes
per-layer ops and Python. Anything else is finished job by job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .kernels import linear_sq_norms
from .linear_grams import (
    PRODUCT_CONTRACTION,
    contract_output_grams,
    resolve_block,
    row_blocks,
    upper_gram,
    widen,
)


def _plain(*tensors: torch.Tensor) -> bool:
    """Not DTensors (whose Grams stay full, see :meth:`GramCache.block_for`)."""
    return all(type(t) is torch.Tensor for t in tensors)


def memory_key(t: torch.Tensor) -> tuple:
    """Identifies a tensor's memory (the readers keep it alive, so no other tensor can reuse it)."""
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class GramCache:
    """Input Gram matrices of the current backward, each dropped after its last reader.

    Args:
        block: Tokens per row block of the Grams (:func:`.linear_grams.upper_gram`): a number
            (0: full Grams) or ``"auto"`` (by the input's device,
            :func:`.linear_grams.resolve_block`).
    """

    def __init__(self, block: int | str = 0) -> None:
        self.block = block
        self._readers: dict[tuple, int] = {}
        self._total: dict[tuple, int] = {}
        self._grams: dict[tuple, tuple[int, list[torch.Tensor]]] = {}

    def note_input(self, activation: torch.Tensor) -> None:
        """Forward hook side: one more ``Linear`` reads ``activation``."""
        if activation.dim() == 3 and type(activation) is torch.Tensor:  # not a DTensor
            k = memory_key(activation)
            self._readers[k] = self._readers.get(k, 0) + 1
            self._total[k] = self._total.get(k, 0) + 1

    def readers(self, activation: torch.Tensor) -> int:
        """How many ``Linear`` layers read ``activation`` in this backward (at least 1)."""
        if type(activation) is not torch.Tensor:
            return 1
        return max(1, self._total.get(memory_key(activation), 0))

    def block_for(self, *tensors: torch.Tensor) -> int:
        """The row block for Grams of ``tensors``: 0 (full) if any is not a plain tensor."""
        if not all(type(t) is torch.Tensor for t in tensors):
            return 0
        return resolve_block(self.block, tensors[0].device)

    def gram(self, activation: torch.Tensor, block: int) -> list[torch.Tensor]:
        """Row blocks of ``A A^T`` per sample, off-diagonal parts doubled (``upper_gram``).

        Computed once while more readers (asking for the same ``block``) are to come.
        """
        if type(activation) is not torch.Tensor:  # a DTensor: not cached
            return upper_gram(activation, block)
        k = memory_key(activation)
        left = self._readers.get(k, 0)
        g = self._grams.pop(k, None)
        if g is None or g[0] != block:
            g = (block, upper_gram(activation, block))
        if left > 1:
            self._readers[k] = left - 1
            self._grams[k] = g
        else:
            self._readers.pop(k, None)
        return g[1]

    def skip(self, activation: torch.Tensor) -> None:
        """A reader that will not ask for the Gram (it took per-sample gradients instead)."""
        if type(activation) is not torch.Tensor:
            return
        k = memory_key(activation)
        left = self._readers.get(k, 0)
        if left > 1:
            self._readers[k] = left - 1
        else:
            self._readers.pop(k, None)
            self._grams.pop(k, None)

    def clear(self) -> None:
        """Forgets every count and Gram (end of a backward, or a failed step)."""
        self._readers.clear()
        self._total.clear()
        self._grams.clear()


#: torch's ``at::internal::GRAIN_SIZE``: a CPU reduction over fewer elements runs serially. Over
#: more, with fewer outputs than threads, torch splits each output's sum between the threads,
#: and how depends on the number of outputs.
REDUCTION_GRAIN = 32768
#: Bytes of output-gradient Grams one batched group may hold (the contraction's product as many
#: again); a larger group is finished layer by layer, each Gram dropped after its use.
MAX_GROUP_BYTES = 64 * 2**20


def _may_batch(group: list[GramJob]) -> bool:
    """Whether one contraction over ``group`` sums each row as the per-layer contractions do.

    Bit for bit where neither splits a row's sum between threads: one thread, at least as many
    samples as threads (every row is one thread's), or fewer elements in all than
    :data:`REDUCTION_GRAIN`. And within :data:`MAX_GROUP_BYTES`.
    """
    a = group[0].a
    n, t = a.shape[0], a.shape[1]
    total = len(group) * n * t * t
    threads = torch.get_num_threads()
    serial = threads == 1 or n >= threads or total < REDUCTION_GRAIN
    return serial and total * a.element_size() <= MAX_GROUP_BYTES


@dataclass
class GramJob:
    """A ``Linear`` layer's norm routed to the Grams and not yet computed.

    Attributes:
        layer: The layer.
        a: Its input ``(N, T, d_in)`` (flattened to three dimensions where it had more).
        g: Its output gradient ``(N, T, d_out)``.
        block: Tokens per Gram row block (0: full Grams).
        bias: Whether the bias's norm is asked for.
        shared: Whether ``a`` is the captured input itself (its Gram is the cache's).
    """

    layer: nn.Linear
    a: torch.Tensor
    g: torch.Tensor
    block: int
    bias: bool
    shared: bool


class LinearNormSampler:
    """A norm sampler for ``nn.Linear`` (Opacus's signature) that uses ``cache``.

    Where the fused kernels apply (``fused_kernels``, :func:`.kernels.use_fused`), a sequence
    layer's ghost norm comes from them (:func:`.kernels.linear_sq_norms`) instead of Grams.

    With a :class:`~opacus_fsdp_sync.layers.linear_policy.PerSampleGradPolicy`, a sequence
    layer the policy takes gets its norms from materialised per-sample gradients, which are left
    in ``policy.stash`` for the one-backward gradient phase.

    With a :class:`~opacus_fsdp_sync.tuning.NormTuner`, a sequence layer with plain-tensor
    inputs takes the tuned Gram block and the tuned per-sample decision (in place of
    ``gram_block="auto"`` and the cost rule); the policy's byte budget still applies.
    """

    def __init__(self, cache: GramCache, policy=None, tuner=None, fused_kernels=None) -> None:
        self.cache = cache
        self.policy = policy
        self.tuner = tuner
        self.fused_kernels = fused_kernels

    def __call__(
        self, layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
    ) -> dict:
        """The layer's per-sample norms by parameter (:meth:`route`, then :meth:`finish`)."""
        routed = self.route(layer, activations, backprops)
        return routed if isinstance(routed, dict) else self.finish(routed)

    def route(
        self, layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
    ) -> dict | GramJob:
        """The norms by parameter where they are not a Gram contraction, else its job."""
        cache, policy, tuner = self.cache, self.policy, self.tuner
        a = activations[0]
        out = {}
        choice = None
        if tuner is not None and a.dim() == 3 and _plain(a, backprops):
            choice = tuner.choose(
                layer,
                a,
                backprops,
                readers=cache.readers(a),
                per_sample=policy is not None and policy.may_take(a, backprops),
                group=id(a),
            )
        cheaper = None if choice is None else choice.per_sample
        if policy is not None and a.dim() == 3 and policy.take(layer, a, backprops, cheaper):
            if layer.weight.requires_grad:
                cache.skip(a)
            psgs = linear_per_sample_grads(layer, a, backprops)
            policy.stash[id(layer)] = psgs
            return {getattr(layer, n): norm for n, norm in per_sample_norms(psgs).items()}
        if a.dim() != 3:  # one token per sample (or flattened): the rank-one formula
            a2 = a.reshape(a.shape[0], math.prod(a.shape[1:-1]), a.shape[-1])
            g2 = backprops.reshape(a2.shape[0], a2.shape[1], backprops.shape[-1])
            if a2.shape[1] == 1:
                g_sq = widen(g2).pow(2).sum((1, 2))
                if layer.weight.requires_grad:
                    out[layer.weight] = (g_sq * widen(a2).pow(2).sum((1, 2))).sqrt()
                if layer.bias is not None and layer.bias.requires_grad:
                    out[layer.bias] = g_sq.sqrt()
                return out
            a, backprops = a2, g2
        fused = linear_sq_norms(layer, a, backprops, self.fused_kernels)
        if fused is not None:  # no Gram: this reader's count is released
            if layer.weight.requires_grad and a.shape == activations[0].shape:
                cache.skip(a)
            return {getattr(layer, n): sq.clamp(min=0).sqrt() for n, sq in fused.items()}
        return GramJob(
            layer=layer,
            a=a,
            g=backprops,
            block=cache.block_for(a, backprops) if choice is None else choice.block,
            bias=layer.bias is not None and layer.bias.requires_grad,
            shared=a.shape == activations[0].shape,
        )

    def finish(self, job: GramJob) -> dict:
        """The norms by parameter of one :class:`GramJob`."""
        return {p: sq.clamp(min=0).sqrt() for p, sq in self.finish_squares(job).items()}

    def finish_squares(self, job: GramJob) -> dict:
        """The squared norms by parameter of one :class:`GramJob`, before ``clamp`` and ``sqrt``.

        :meth:`finish` takes their elementwise ``clamp(min=0).sqrt()``; the lean lanes take it
        for many layers at once (:func:`finish_tails`), the same numbers.
        """
        layer = job.layer
        aat = None
        if layer.weight.requires_grad:
            aat = self.cache.gram(job.a, job.block) if job.shared else upper_gram(job.a, job.block)
        w_sq, b_sq = contract_output_grams(aat, job.g, job.block, bias=job.bias)
        out = {}
        if w_sq is not None:
            out[layer.weight] = w_sq
        if b_sq is not None:
            out[layer.bias] = b_sq
        return out

    def finish_batch(self, jobs: list[GramJob], scales: list[int]) -> list[dict]:
        """The norms by parameter of each job, times its scale (see the module docstring).

        Args:
            jobs: Gram jobs of one pass, in the order their layers reported.
            scales: Each job's factor for its norms (the batch size for a mean loss, else 1),
                applied as the hooks apply it (a multiplication of the finished norm).

        Returns:
            One dict per job, in order. The jobs no group takes are contracted one by one and
            their ``clamp``/``sqrt``/scale taken together (:func:`finish_tails`), bit for bit
            the per-layer route's numbers.
        """
        out: list[dict | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        for i, job in enumerate(jobs):
            if self.batchable(job):
                groups.setdefault((memory_key(job.a), scales[i]), []).append(i)
        for (_, scale), members in groups.items():
            group = [jobs[i] for i in members]
            if len(group) > 1 and _may_batch(group):
                for i, norms in zip(members, self._finish_group(group, scale)):
                    out[i] = norms
        # the rest job by job, their clamp/sqrt/scale together (finish_tails: the same numbers)
        owners: list[tuple[int, torch.Tensor]] = []
        squares: list[torch.Tensor] = []
        for i, job in enumerate(jobs):
            if out[i] is None:
                out[i] = {}
                for p, sq in self.finish_squares(job).items():
                    owners.append((i, p))
                    squares.append(sq)
        tails = finish_tails(squares, [scales[i] for i, _ in owners])
        for (i, p), norm in zip(owners, tails):
            out[i][p] = norm
        return out

    def batchable(self, job: GramJob) -> bool:
        """Whether :meth:`finish_batch` may finish ``job`` with the other readers of its input.

        One Gram row block of a trainable weight's cached input, fp32 or fp64, on a device whose
        contractions multiply and sum (:data:`.linear_grams.PRODUCT_CONTRACTION`).
        """
        a, g = job.a, job.g
        return (
            job.shared
            and job.layer.weight.requires_grad
            and _plain(a, g)
            and a.dtype == g.dtype
            and g.dtype in (torch.float32, torch.float64)
            and a.device.type in PRODUCT_CONTRACTION
            and len(row_blocks(a.shape[1], job.block)) == 1
        )

    def _finish_group(self, jobs: list[GramJob], scale: int) -> list[dict]:
        """Readers of one input: their output-gradient Grams in one buffer, one contraction."""
        a = jobs[0].a
        n, t = a.shape[0], a.shape[1]
        grams = torch.empty((len(jobs), n, t, t), dtype=a.dtype, device=a.device)
        aat = None
        for r, job in enumerate(jobs):
            aat = self.cache.gram(a, job.block)[0]  # once per reader: the cache counts them
            torch.bmm(job.g, job.g.transpose(1, 2), out=grams[r])
        k = t * t
        w = torch.linalg.vecdot(aat.reshape(1, n, k), grams.view(len(jobs), n, k))
        w = w.clamp(min=0).sqrt()
        if scale != 1:
            w = w * scale
        out = []
        for r, job in enumerate(jobs):
            layer = job.layer
            norms = {layer.weight: w[r]}
            if job.bias:
                b_sq = contract_output_grams(None, job.g, job.block, bias=True)[1]
                b = b_sq.clamp(min=0).sqrt()
                norms[layer.bias] = b if scale == 1 else b * scale
            out.append(norms)
        return out


def make_linear_norm_sampler(
    cache: GramCache, policy=None, tuner=None, fused_kernels=None
) -> LinearNormSampler:
    """A :class:`LinearNormSampler` (Opacus's sampler signature when called)."""
    return LinearNormSampler(cache, policy, tuner, fused_kernels)


def linear_per_sample_grads(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``{"weight": (N, d_out, d_in), "bias": (N, d_out)}`` for the trainable parameters."""
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = torch.bmm(g.transpose(1, 2), a.to(g.dtype))
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = g.sum(1)
    return out


def per_sample_norms(psgs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's per-sample gradient norm, accumulated in fp32 (fp64 for fp64)."""
    return {
        name: torch.linalg.vector_norm(
            t.flatten(1), dim=1, dtype=torch.promote_types(t.dtype, torch.float32)
        )
        for name, t in psgs.items()
    }


def finish_tails(squares: list[torch.Tensor], scales: list[int]) -> list[torch.Tensor]:
    """``squares[i].clamp(min=0).sqrt() * scales[i]`` for every ``i``, in few ops.

    Squared norms of one shape, dtype and device are stacked and finished by one ``clamp``, one
    ``sqrt`` and one multiplication per distinct scale. Each is elementwise, so every row is the
    number the per-layer route computes (``.clamp(min=0).sqrt()``, then times the scale where it
    is not 1), bit for bit; what it saves is ops (on a GPU, launches) and Python.

    Args:
        squares: Per-sample squared norms, ``(N,)`` each.
        scales: Each one's factor (the batch size for a mean loss, else 1).

    Returns:
        The norms, in order: views of the stacked results.
    """
    out: list[torch.Tensor | None] = [None] * len(squares)
    groups: dict[tuple, list[int]] = {}
    for i, sq in enumerate(squares):
        groups.setdefault((sq.shape, sq.dtype, sq.device, scales[i]), []).append(i)
    for (_, _, _, scale), members in groups.items():
        stacked = torch.stack([squares[i] for i in members]).clamp_(min=0).sqrt_()
        if scale != 1:
            stacked.mul_(scale)
        for i, row in zip(members, stacked.unbind(0)):
            out[i] = row
    return out
