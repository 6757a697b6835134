"""The ``Embedding`` room: padding-aware ghost norm and clipped gradient from the token ids.

Both read the token ids ``x`` and the output gradient ``e`` (``N x S x D``): the norm is
Opacus's ghost norm of the gradient ``sum_s onehot(x_s) e_s^T`` with the positions holding
``padding_idx`` dropped (autograd gives that row no gradient); the clipped gradient is
``embedding_dense_backward`` of the scaled output gradient, which drops them too. A per-sample
gradient (``N x V x D``) is never materialised.
"""

from __future__ import annotations

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from torch import nn

from .registry import LayerRoom, Unavailable, register_layer, scale_rows

_UPSTREAM_EMBEDDING_NORM = GradSampleHooksFastGradientClipping.NORM_SAMPLERS[nn.Embedding]


def padding_aware_embedding_norm(layer: nn.Embedding, activations, backprops) -> dict:
    """Opacus's embedding norm sampler, without the positions holding ``padding_idx``.

    Autograd gives the ``padding_idx`` row no gradient; upstream's sampler ignores that and
    over-estimates the norm of any sample containing the padding token. Index tensors are made
    contiguous first (upstream calls ``.view()`` on them and fails on a sliced input).
    """
    activations = [activations[0].contiguous(), *activations[1:]]
    if layer.padding_idx is not None:
        # a bool mask: the product keeps backprops' dtype and values, without a cast of the mask
        keep = (activations[0] != layer.padding_idx).unsqueeze(-1)
        backprops = backprops * keep
    return _UPSTREAM_EMBEDDING_NORM(layer, activations, backprops)


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
