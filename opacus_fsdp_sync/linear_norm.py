"""Ghost norms of ``Linear`` layers: Gram matrices shared between layers that read one input.

For a sequence input, sample n's weight-gradient norm is ``sqrt(<A_n A_n^T, G_n G_n^T>)``
(``A_n`` the layer input, ``G_n`` its output gradient, both ``T x d``). Upstream Opacus computes
both Gram matrices for every layer and contracts them with an ``einsum`` that becomes a batched
matrix-vector product (a cuBLAS gemv over ``T^2`` elements, about 0.5 ms a layer on an H100 at
T = 1024). Here:

- the input Gram ``A_n A_n^T`` is computed once per backward for all layers that read the same
  tensor (``q``/``k``/``v`` and ``gate``/``up`` in a Llama block): the forward hook counts the
  readers, the backward releases the Gram after the last one;
- the contraction is an elementwise product and a sum accumulated in fp32 (fp64 for fp64);
- with ``gram_block`` (see :mod:`.block_gram`), only the upper block triangle of each symmetric
  Gram is computed, up to about half the Gram FLOPs saved.

The result equals upstream's to floating-point rounding (not bit for bit: the summation order
differs); ``fast_norms=False`` in :class:`~opacus_fsdp_sync.options.GhostOptions` keeps upstream's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .block_gram import contract_output_grams, resolve_block, upper_gram, widen


def _plain(*tensors: torch.Tensor) -> bool:
    """Not DTensors (whose Grams stay full, see :meth:`GramCache.block_for`)."""
    return all(type(t) is torch.Tensor for t in tensors)


def _key(t: torch.Tensor) -> tuple:
    """Identifies a tensor's memory (the readers keep it alive, so no other tensor can reuse it)."""
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class GramCache:
    """Input Gram matrices of the current backward, each dropped after its last reader.

    Args:
        block: Tokens per row block of the Grams (:func:`.block_gram.upper_gram`): a number
            (0: full Grams) or ``"auto"`` (by the input's device,
            :func:`.block_gram.resolve_block`).
    """

    def __init__(self, block: int | str = 0) -> None:
        self.block = block
        self._readers: dict[tuple, int] = {}
        self._total: dict[tuple, int] = {}
        self._grams: dict[tuple, tuple[int, list[torch.Tensor]]] = {}

    def note_input(self, activation: torch.Tensor) -> None:
        """Forward hook side: one more ``Linear`` reads ``activation``."""
        if activation.dim() == 3 and type(activation) is torch.Tensor:  # not a DTensor
            k = _key(activation)
            self._readers[k] = self._readers.get(k, 0) + 1
            self._total[k] = self._total.get(k, 0) + 1

    def readers(self, activation: torch.Tensor) -> int:
        """How many ``Linear`` layers read ``activation`` in this backward (at least 1)."""
        if type(activation) is not torch.Tensor:
            return 1
        return max(1, self._total.get(_key(activation), 0))

    def block_for(self, *tensors: torch.Tensor) -> int:
        """The row block for Grams of ``tensors``: 0 (full) if any is not a plain tensor."""
        if not all(type(t) is torch.Tensor for t in tensors):
            return 0
        return resolve_block(self.block, tensors[0].device)

    def gram(self, activation: torch.Tensor, block: int) -> list[torch.Tensor]:
        """Row blocks of ``A A^T`` per sample (:func:`.block_gram.upper_gram`).

        Computed once while more readers (asking for the same ``block``) are to come.
        """
        if type(activation) is not torch.Tensor:  # a DTensor: not cached
            return upper_gram(activation, block)
        k = _key(activation)
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
        k = _key(activation)
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


def make_linear_norm_sampler(cache: GramCache, policy=None, tuner=None):
    """A norm sampler for ``nn.Linear`` (Opacus's signature) that uses ``cache``.

    With a :class:`~opacus_fsdp_sync.one_backward.per_sample.PerSampleGradPolicy`, a sequence
    layer the policy takes gets its norms from materialised per-sample gradients, which are left
    in ``policy.stash`` for the one-backward gradient phase.

    With a :class:`~opacus_fsdp_sync.norm_tuner.NormTuner`, a sequence layer with plain-tensor
    inputs takes the tuned Gram block and the tuned per-sample decision (in place of
    ``gram_block="auto"`` and the cost rule); the policy's byte budget still applies.
    """

    def linear_norm_sample(
        layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
    ) -> dict:
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
            from .one_backward.per_sample import linear_per_sample_grads, per_sample_norms

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
        bias = layer.bias is not None and layer.bias.requires_grad
        block = cache.block_for(a, backprops) if choice is None else choice.block
        aat = None
        if layer.weight.requires_grad:
            shared = a.shape == activations[0].shape
            aat = cache.gram(a, block) if shared else upper_gram(a, block)
        w_sq, b_sq = contract_output_grams(aat, backprops, block, bias=bias)
        if w_sq is not None:
            out[layer.weight] = w_sq.clamp(min=0).sqrt()
        if b_sq is not None:
            out[layer.bias] = b_sq.clamp(min=0).sqrt()
        return out

    return linear_norm_sample
