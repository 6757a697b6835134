"""The tied-weight room: a shared weight's per-sample norm from its uses' tensors.

A weight used by several ``Linear`` / ``Embedding`` layers (tied input and output embeddings)
is not a layer type: each use is computed by its layer's room, and this room adds what the
sharing changes. Its norm is the cross term of two uses (:meth:`TiedRoom.norm`, below); its
clipped gradient is the sum of the uses' clipped gradients (:meth:`TiedRoom.clipped_grad`); a
per-sample gradient is never formed. Also here: finding shared weights and refusing the pairs
this room cannot compute (:func:`find_shared_parameters`, :func:`check_supported`). The hooks
that collect the uses in backward are :mod:`opacus_fsdp_sync.hooks.tied`.

Per-sample inner products of two uses' gradients of one shared weight, never materialised:

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
from dataclasses import dataclass, field

import torch
from torch import nn

from .linear_grams import try_wide_bmm
from .registry import LayerRoom, Unavailable, register_layer

#: Module types whose shared weights we can pair.
SUPPORTED = (nn.Linear, nn.Embedding)


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """``(N, ..., F)`` -> ``(N, T, F)`` in fp32 (a 2-D input gets ``T = 1``)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1]).float()


def _flat_3d(t: torch.Tensor) -> torch.Tensor:
    """``(N, ..., F)`` -> ``(N, T, F)`` in its own dtype."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def token_ids(x: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (N, S) long, mask (N, S))``: mask is 0 (False) at ``padding_idx`` positions.

    The mask is float ones without a ``padding_idx`` and bool with one (a product with it
    promotes exactly, without a cast of its own).
    """
    ids = x.reshape(x.shape[0], math.prod(x.shape[1:])).long()
    if padding_idx is None:
        return ids, torch.ones_like(ids, dtype=torch.float32)
    return ids, ids != padding_idx


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
    # gathered in b's own dtype: the (N, T, V) gradient is never copied whole
    a, b = _flat_3d(a), _flat_3d(b)
    ids, mask = token_ids(x, padding_idx)
    gathered = torch.gather(b, 2, ids.unsqueeze(1).expand(-1, b.shape[1], -1))  # (N, T, S)
    partial = None
    if a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16):
        # where the matmul writes fp32 from narrow operands itself (CUDA): no widened copies
        partial = try_wide_bmm(gathered.transpose(1, 2), a)
    if partial is None:
        partial = torch.einsum("nts,nti->nsi", gathered.float(), a.float())
    return partial * mask.unsqueeze(-1)


def partial_embedding(partial, e) -> torch.Tensor:
    """``<G_linear, G_embedding>`` from :func:`linear_partial` and the embedding's ``e``."""
    # fp32 partial times e in its own dtype: the product promotes e exactly, without a copy
    e = _flat_3d(e)
    if not e.is_floating_point() or e.dtype == torch.float64:
        e = e.float()
    return (partial * e).sum(dim=(1, 2))


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


class _Use:
    """What one layer's use of a shared weight leaves for the pairs formed later in backward."""

    def __init__(self, module: nn.Module, inputs: torch.Tensor, grads: torch.Tensor | None):
        self.module = module
        self.inputs = inputs  # Linear: activations a; Embedding: token ids x
        self.grads = grads  # Linear: output gradient b (None once reduced); Embedding: e
        self.partials: dict[nn.Module, torch.Tensor] = {}  # Embedding owner -> linear_partial


def pad(module: nn.Module) -> int | None:
    """The layer's ``padding_idx`` (None for a Linear)."""
    return getattr(module, "padding_idx", None)


@register_layer()
class TiedRoom(LayerRoom):
    """A weight shared by ``Linear`` / ``Embedding`` layers: see the module.

    Its norm and clipped gradient take uses of the weight, not one layer's tensors.
    """

    name = "tied"
    per_sample_grad = Unavailable(
        "per-sample gradient",
        "a shared weight's per-sample gradient is the sum of its uses'; only their inner "
        "products are formed (the norm's cross terms)",
    )

    Use = _Use

    def norm(self, first: _Use, second: _Use) -> torch.Tensor:
        """``<G_first, G_second>`` per sample: the cross term two uses add to the squared norm.

        The squared norm of the shared weight is the sum of its uses' own squared norms (their
        layers' rooms) plus twice this for every pair of uses.
        """
        m1, m2 = first.module, second.module
        lin1, lin2 = isinstance(m1, nn.Linear), isinstance(m2, nn.Linear)
        if lin1 and lin2:
            return linear_linear(first.inputs, first.grads, second.inputs, second.grads)
        if lin1:
            if m2 in first.partials:
                return partial_embedding(first.partials[m2], second.grads)
            return linear_embedding(first.inputs, first.grads, second.inputs, second.grads, pad(m2))
        if lin2:
            return linear_embedding(second.inputs, second.grads, first.inputs, first.grads, pad(m1))
        return embedding_embedding(
            first.inputs, first.grads, pad(m1), second.inputs, second.grads, pad(m2)
        )

    def clipped_grad(self, uses: list[torch.Tensor]) -> torch.Tensor:
        """A shared weight's clipped gradient: the sum of its uses' clipped gradients.

        Unlike a layer's room, this one takes the uses' clipped gradients (each from its own
        layer's room); two backward passes get the same sum from autograd.
        """
        total = uses[0]
        for g in uses[1:]:
            total = total + g
        return total


class UnsupportedTiedParameterError(NotImplementedError):
    """A weight shared between layers whose per-sample cross term we cannot compute."""


@dataclass
class SharedParameter:
    """One weight and the layers that use it.

    Attributes:
        param: The parameter as registered at construction (FSDP2 swaps in an unsharded
            parameter during forward and backward, so hooks look it up by ``local_name``).
        owners: ``(qualified name, module, attribute name on that module)`` per use.
    """

    param: nn.Parameter
    owners: list[tuple[str, nn.Module, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The first qualified name of the weight."""
        return self.owners[0][0]


def find_shared_parameters(
    model: nn.Module, hooked: frozenset[int] | None = None
) -> list[SharedParameter]:
    """Trainable parameters registered on more than one module (the same ``Parameter`` object).

    A module registered twice under two names appears once in ``named_modules()``; calling one
    module twice per forward is caught at run time instead.

    Args:
        model: The model.
        hooked: ``id`` of every module the norm hooks see, or None for every registration (what
            sharding must keep in one unit). Given, a registration on a module that is not
            hooked and is an ancestor of another owner is an alias, not a use: Opacus's
            ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` re-expose their ``RNNLinear`` cells' weights under
            ``nn.LSTM``'s names, and only the cells compute with them (and are hooked).

    Returns:
        Each weight with more than one use, and its uses.
    """
    by_id: dict[int, SharedParameter] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                entry = by_id.setdefault(id(p), SharedParameter(p))
                entry.owners.append((f"{mname}.{pname}" if mname else pname, module, pname))
    shared = [s for s in by_id.values() if len(s.owners) > 1]
    if hooked is not None:
        for s in shared:
            s.owners = [o for o in s.owners if not _alias(o, s.owners, hooked)]
        shared = [s for s in shared if len(s.owners) > 1]
    return shared


def _alias(owner: tuple, owners: list[tuple], hooked: frozenset[int]) -> bool:
    """Whether an owner only re-exposes a descendant owner's parameter (see above)."""
    module = owner[1]
    if id(module) in hooked:
        return False
    below = {id(m) for m in module.modules() if m is not module}
    return any(id(other) in below for _, other, _ in owners)


def check_supported(shared: list[SharedParameter], norm_samplers: dict, type_of=type) -> None:
    """Raises for a shared weight whose owners are not Linear/Embedding ghost-clipping layers.

    Raises:
        UnsupportedTiedParameterError: naming the parameter, the modules and the way out.
    """
    for s in shared:
        for qname, module, _ in s.owners:
            kind = type_of(module)
            if not issubclass(kind, SUPPORTED) or kind not in norm_samplers:
                users = ", ".join(f"{n} ({type_of(m).__name__})" for n, m, _ in s.owners)
                raise UnsupportedTiedParameterError(
                    f"Parameter '{s.name}' is shared by {users}; exact ghost-clipping norms of "
                    f"a shared weight are supported between nn.Linear and nn.Embedding layers "
                    f"only, not {kind.__name__} ('{qname}'). Untie it (for a Hugging Face model: "
                    "config.tie_word_embeddings=False before building, or "
                    "`layer.weight = nn.Parameter(layer.weight.detach().clone())`), or use "
                    "grad_sample_mode='hooks'."
                )
