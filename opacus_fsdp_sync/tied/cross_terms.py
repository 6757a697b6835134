"""Per-sample inner products of two uses' gradients of one shared weight, never materialised.

For a weight ``W`` used by two layers, sample n's gradient is ``G1 + G2`` and
``|G1 + G2|^2 = |G1|^2 + |G2|^2 + 2 <G1, G2>``. Opacus's norm samplers give the first two terms;
this module gives ``<G1, G2>`` from each use's input (``a`` or token ids ``x``) and output
gradient (``b`` or ``e``), already rearranged by Opacus (batch first, scaled for the loss
reduction). Shapes: Linear ``a (N, T, I)``, ``b (N, T, O)`` with ``W`` of shape ``(O, I)``;
Embedding ``x (N, S)``, ``e (N, S, D)`` with ``W`` of shape ``(V, D)``.

- Linear-Linear: ``sum_{t,u} (b_t . b'_u)(a_t . a'_u)``
- Linear-Embedding: ``sum_{t,s} b_t[x_s] (a_t . e_s)`` (``O = V``, ``I = D``), O(T S D) per sample
- Embedding-Embedding: ``sum_{s,u} [x_s = x'_u] (e_s . e'_u)``

Positions holding an embedding's ``padding_idx`` get no gradient in autograd and are dropped.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: Module types whose shared weights we can pair.
SUPPORTED = (nn.Linear, nn.Embedding)


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """``(N, ..., F)`` -> ``(N, T, F)`` in fp32 (a 2-D input gets ``T = 1``)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1]).float()


def token_ids(x: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (N, S) long, mask (N, S) float)``: mask is 0 at ``padding_idx`` positions."""
    ids = x.reshape(x.shape[0], math.prod(x.shape[1:])).long()
    mask = torch.ones_like(ids, dtype=torch.float32)
    if padding_idx is not None:
        mask = (ids != padding_idx).float()
    return ids, mask


def linear_linear(a1, b1, a2, b2) -> torch.Tensor:
    """``<G1, G2>`` per sample for two Linear uses of one weight."""
    a1, b1, a2, b2 = as_3d(a1), as_3d(b1), as_3d(a2), as_3d(b2)
    bb = torch.einsum("nto,nuo->ntu", b1, b2)
    aa = torch.einsum("nti,nui->ntu", a1, a2)
    return (bb * aa).sum(dim=(1, 2))


def linear_partial(a, b, x, padding_idx) -> torch.Tensor:
    """``P_s = sum_t b_t[x_s] a_t``, shape ``(N, S, I)``: a Linear use against token ids.

    Reducing the Linear's ``(N, T, V)`` output gradient against the ids of an Embedding use that
    has not fired yet lets that gradient be freed at once.
    """
    a, b = as_3d(a), as_3d(b)
    ids, mask = token_ids(x, padding_idx)
    gathered = torch.gather(b, 2, ids.unsqueeze(1).expand(-1, b.shape[1], -1))  # (N, T, S)
    return torch.einsum("nts,nti->nsi", gathered, a) * mask.unsqueeze(-1)


def partial_embedding(partial, e) -> torch.Tensor:
    """``<G_linear, G_embedding>`` from :func:`linear_partial` and the embedding's ``e``."""
    return (partial * as_3d(e)).sum(dim=(1, 2))


def linear_embedding(a, b, x, e, padding_idx) -> torch.Tensor:
    """``<G_linear, G_embedding>`` per sample."""
    return partial_embedding(linear_partial(a, b, x, padding_idx), e)


def embedding_embedding(x1, e1, pad1, x2, e2, pad2) -> torch.Tensor:
    """``<G1, G2>`` per sample for two Embedding uses of one weight."""
    ids1, m1 = token_ids(x1, pad1)
    ids2, m2 = token_ids(x2, pad2)
    same = (ids1.unsqueeze(2) == ids2.unsqueeze(1)).float() * m1.unsqueeze(2) * m2.unsqueeze(1)
    ee = torch.einsum("nsd,nud->nsu", as_3d(e1), as_3d(e2))
    return (same * ee).sum(dim=(1, 2))
