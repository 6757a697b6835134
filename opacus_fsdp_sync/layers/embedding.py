"""The ``Embedding`` room: padding-aware ghost norm and clipped gradient from the token ids.

Both read the token ids ``x`` and the output gradient ``e`` (``N x S x D``): the norm is that
of the gradient ``sum_s onehot(x_s) e_s^T`` (Opacus's ghost norm, summed in the same order)
with the positions holding ``padding_idx`` dropped (autograd gives that row no gradient); the
clipped gradient is ``embedding_dense_backward`` of the scaled output gradient, which drops
them too. A per-sample gradient (``N x V x D``) is never materialised.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .registry import LayerRoom, Unavailable, register_layer, scale_rows


def padding_aware_embedding_norm(layer: nn.Embedding, activations, backprops) -> dict:
    """Per-sample norms of the embedding's gradient, without the positions holding ``padding_idx``.

    A sample's gradient has one row per distinct token it holds: the sum of the output
    gradients at that token's positions. Each (sample, token) pair is one integer key
    ``sample * V + token``; the gradients are summed per key (in fp32 at least) and the squared
    row norms per sample, in the keys' sorted order, as Opacus's sampler sums them (which
    pairs the two indices with a slower row-wise ``unique``). Autograd gives the ``padding_idx``
    row no gradient; upstream's sampler ignores that and over-estimates the norm of any sample
    containing the padding token: those positions are zeroed here first.
    """
    ids = activations[0]
    if layer.padding_idx is not None:
        # a bool mask: the product keeps backprops' dtype and values, without a cast of the mask
        backprops = backprops * (ids != layer.padding_idx).unsqueeze(-1)
    n, d = ids.shape[0], backprops.shape[-1]
    per_sample = math.prod(ids.shape[1:])  # explicit: an empty batch has no -1 to infer
    wide = torch.promote_types(backprops.dtype, torch.float32)
    offsets = torch.arange(n, device=ids.device).mul_(layer.num_embeddings).unsqueeze(1)
    keys = (ids.reshape(n, per_sample).long() + offsets).reshape(-1)
    position, owner = sorted_key_slots(keys, layer.num_embeddings)
    rows = torch.zeros(keys.numel(), d, dtype=wide, device=backprops.device)
    rows.index_add_(0, position, backprops.reshape(-1, d).to(wide))
    sq = torch.zeros(n, dtype=wide, device=backprops.device)
    sq.index_add_(0, owner, rows.pow(2).sum(1))
    return {layer.weight: sq.sqrt()}


def sorted_key_slots(keys: torch.Tensor, per_owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(keys, sorted=True, return_inverse=True)`` without its device sync.

    ``unique`` returns as many distinct keys as there are, a number the host must read back from
    the device (a synchronisation that, in the middle of the first pass, let the GPU run dry).
    Here each key's slot is its rank among the distinct keys, from a sort and a running count of
    key changes, and there are as many slots as keys: the first slots are ``unique``'s, in its
    order, and the rest hold nothing.

    Args:
        keys: ``(K,)`` int64 keys ``owner * per_owner + token``.
        per_owner: Keys per owner (the vocabulary size).

    Returns:
        ``(position, owner)``: ``position[k]`` is the slot of ``keys[k]`` (``unique``'s inverse);
        ``owner[j]`` is slot ``j``'s key divided by ``per_owner`` (0 for a slot holding nothing,
        whose row stays zero).
    """
    ordered, order = torch.sort(keys)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    slot = starts.cumsum(0).sub_(1)
    position = torch.empty_like(slot).scatter_(0, order, slot)
    owner = torch.zeros_like(slot).scatter_(0, slot, ordered.div(per_owner, rounding_mode="floor"))
    return position, owner


@register_layer(nn.Embedding)
class EmbeddingRoom(LayerRoom):
    """``nn.Embedding``: see the module."""

    name = "embedding"
    norm = staticmethod(padding_aware_embedding_norm)
    per_sample_grad = Unavailable(
        "per-sample gradient",
        "an embedding's per-sample gradient is N x V x D; its norm and clipped gradient are "
        "computed from the token ids and output gradient instead",
    )

    def clipped_grad(self, layer, inputs, grad_out, scale):
        """``embedding_dense_backward`` of the scaled output gradient (padding rows get none)."""
        ids = inputs[0]
        pad = -1 if layer.padding_idx is None else layer.padding_idx
        grad = torch.ops.aten.embedding_dense_backward(
            scale_rows(grad_out, scale), ids, layer.num_embeddings, pad, layer.scale_grad_by_freq
        )
        return {"weight": grad}
