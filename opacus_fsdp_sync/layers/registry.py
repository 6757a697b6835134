"""Which room computes a layer's per-sample norm, per-sample gradient and clipped gradient.

As Opacus registers a grad sampler per layer type (``register_grad_sampler`` in
``opacus/grad_sample/utils.py``), a room registers itself for its layer types::

    @register_layer(nn.Linear)
    class LinearRoom(LayerRoom):
        ...

The hooks build their norm-sampler table from the registry (:func:`norm_samplers`) and the
one-backward step takes each layer's clipped gradient from :func:`room_for`, so registering a room
is all a new layer type needs. A room matched by what a layer computes rather than by its type
(RMSNorm-like layers) registers with ``match=`` instead. Layers no room claims take the generic
room (the exact replay); tied weights have their own room (:data:`TIED`), found by name.

Norms and clipped gradients come from one room, found by one rule (:func:`room_for`): the room
of the layer's own type, else of its most specific registered base class where no class in
between defines its own ``forward`` (a subclass that only adds attributes computes what its base
computes), else a matching room, else the generic one. A subclass that overrides ``forward``
(``gelu(super().forward(x))``, an embedding that scales its output) computes another function:
the base's formula would clip it silently wrong (36 % off the clip-each-sample loop for such a
``Linear``), so it takes the generic room, as any layer no room claims. Opacus's own sampler for
a layer's exact type (``RNNLinear``'s) keeps precedence for the norm, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from torch import nn

from .kernels.rows import scale_rows_kernel


class Unavailable:
    """An explicit "this room has none" in place of a function; calling it raises.

    Args:
        what: What is missing (``"per-sample gradient"``, ...).
        why: Why, for the reader and the error.
    """

    def __init__(self, what: str, why: str) -> None:
        self.what, self.why = what, why

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args, **kwargs):
        """Raises: the room has no such function."""
        raise NotImplementedError(f"no {self.what}: {self.why}")

    def __repr__(self) -> str:
        return f"Unavailable({self.what!r}: {self.why})"


class LayerRoom:
    """One layer type's per-sample norm, per-sample gradient and clipped gradient.

    All three read the same tensors: the layer's captured inputs and its output gradient (batch
    first; for :meth:`norm` and :meth:`per_sample_grad` scaled so that row n belongs to sample n's
    loss, as Opacus's ``rearrange_grad_samples`` returns it). A room without one of them sets the
    attribute to an :class:`Unavailable` saying why.

    Attributes:
        name: The room's name (logs, tests).
        direct: Whether :meth:`clipped_grad` is a formula that never reads the parameters (it may
            then run on sharded parameters); False for the generic replay.
    """

    name: str = ""
    direct: bool = True
    #: Whether the room's methods take ``sequence_group=`` (the group a layer's input is
    #: split over along the tokens) and sum the per-sample and clipped gradients over it.
    sums_sequence_shards: bool = False

    def refusal(self, layer: nn.Module) -> str | None:
        """Why the room cannot clip ``layer``'s gradient per sample (None: it can).

        Every room refuses a layer with ``scale_grad_by_freq`` set (``nn.Embedding``,
        ``nn.EmbeddingBag``): its batch gradient divides each token's row by the token's count
        over the whole batch, a sample's by the count within that sample, so no sum of clipped
        per-sample gradients is that gradient (up to 69 % off the clip-each-sample loop).
        """
        if vars(layer).get("scale_grad_by_freq", False):
            return (
                f"{type(layer).__name__}(scale_grad_by_freq=True) scales each token's gradient "
                "by its count over the batch, which no per-sample clipping can reproduce; set "
                "scale_grad_by_freq=False"
            )
        return None

    def matches(self, module: nn.Module, module_type: type) -> bool:
        """Whether this room computes ``module`` (rooms registered with ``match=``)."""
        return True

    def types_in(self, model: nn.Module) -> set[type]:
        """The layer types of ``model`` this room computes (rooms registered with ``match=``)."""
        return set()

    def norm(self, layer: nn.Module, activations: list, backprops: torch.Tensor) -> dict:
        """Per-sample gradient norms ``{parameter: (N,)}`` (Opacus's norm-sampler signature)."""
        raise NotImplementedError

    def per_sample_grad(
        self, layer: nn.Module, activations: list, backprops: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-sample gradients ``{name: (N, *param.shape)}`` of the trainable parameters."""
        raise NotImplementedError

    def clipped_grad(
        self, layer: nn.Module, inputs: list, grad_out: torch.Tensor, scale: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``{name: sum_n c_n grad_n}``.

        Args:
            layer: The layer.
            inputs: Its kept inputs.
            grad_out: Its output gradient ``b`` (batch first), unscaled.
            scale: ``(N,)`` fp32 (fp64 for fp64 tensors): sample n's factor ``c_n`` (clipping
                coefficient, times the batch size for a mean loss). A room applies it to the
                narrowest operand it can (:func:`scale_rows`), never to more than the output
                gradient.
        """
        raise NotImplementedError

    def clipped_grad_folded(
        self,
        layer: nn.Module,
        inputs: list,
        grad_out: torch.Tensor,
        coef: torch.Tensor,
        fused_kernels: bool | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """:meth:`clipped_grad` with the coefficients ``coef`` (``(N,)``) applied by a kernel.

        ``grad_out`` is not yet scaled. None (the default): the room has no such kernel here,
        and the caller calls :meth:`clipped_grad` with the same scale.
        """
        return None


def scale_rows(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None):
    """``t`` with row n (along dim 0) multiplied by ``scale[n]``, in ``dtype`` (default ``t``'s).

    One kernel: the product is formed in fp32 (fp64 for fp64 operands) and rounded once to
    ``dtype``; on CUDA a Triton
    kernel that computes the same bits (:func:`.kernels.rows.scale_rows_kernel`: torch's
    broadcast, casting multiply is not vectorised there).
    """
    fast = scale_rows_kernel(t, scale, dtype or t.dtype)
    if fast is not None:
        return fast
    shape = (t.shape[0],) + (1,) * (t.dim() - 1)
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    return torch.mul(t, scale.view(shape), out=out)


#: Where a norm sampler leaves the per-sample gradients it computed on the way (see below).
_KEPT_ATTRIBUTE = "_ghost_per_sample_grads"


def keep_per_sample(layer: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Leaves per-sample gradients a norm computed (``{name: (N, *shape)}``) on ``layer``.

    The first pass takes them (:func:`take_per_sample`) right after the layer's norm hook, and
    the one-backward step then forms the clipped gradient as their weighted sum instead of
    recomputing it from the layer's inputs. They belong to the output gradient the norm saw.
    """
    layer.__dict__[_KEPT_ATTRIBUTE] = grads


def take_per_sample(layer: nn.Module) -> dict[str, torch.Tensor] | None:
    """The per-sample gradients :func:`keep_per_sample` left on ``layer`` (and forgets them)."""
    return layer.__dict__.pop(_KEPT_ATTRIBUTE, None)


_BY_TYPE: dict[type, LayerRoom] = {}
_MATCHED: list[LayerRoom] = []
_NAMED: dict[str, LayerRoom] = {}


def register_layer(*types: type, match: bool = False) -> Callable:
    """Class decorator: registers one instance of the decorated :class:`LayerRoom`.

    Args:
        *types: Layer types the room computes (a later registration for a type replaces an
            earlier one, as Opacus's decorators do).
        match: Register as a room found by :meth:`LayerRoom.matches` (tried after every typed
            room, in registration order).

    Every room is also registered under its ``name`` (the generic and the tied room only so).
    """

    def decorator(cls: type[LayerRoom]) -> type[LayerRoom]:
        room = cls()
        _NAMED[room.name] = room
        for t in types:
            _BY_TYPE[t] = room
        if match:
            _MATCHED.append(room)
        return cls

    return decorator


def unregister_layer(*types: type) -> None:
    """Forgets the rooms registered for ``types`` (tests)."""
    for t in types:
        _BY_TYPE.pop(t, None)


def room_named(name: str) -> LayerRoom:
    """The room registered under ``name`` (``"linear"``, ``"generic"``, ``"tied"``, ...)."""
    return _NAMED[name]


def rooms() -> dict[str, LayerRoom]:
    """Every registered room by name."""
    return dict(_NAMED)


def typed_rooms() -> dict[type, LayerRoom]:
    """The rooms registered by layer type."""
    return dict(_BY_TYPE)


def _registered_base(module_type: type) -> type | None:
    """The class whose room computes ``module_type`` (None: no typed room does).

    The most specific registered class in ``module_type``'s MRO, provided ``module_type``
    inherits its ``forward``: a class in between that defines its own computes something else.
    """
    for cls in module_type.__mro__:
        if cls in _BY_TYPE:
            return cls if module_type.forward is cls.forward else None
    return None


def room_for(module: nn.Module, module_type: type | None = None) -> LayerRoom:
    """The room that computes ``module``'s per-sample norm and clipped gradient.

    Args:
        module: A hooked layer.
        module_type: The type Opacus sees (FSDP2's ``FSDP<Class>`` mapped back); ``type(module)``
            when None.

    Returns:
        The room of its type, or of its most specific registered base class when it inherits
        that class's ``forward``; else the first matching room; else the generic room.
    """
    module_type = type(module) if module_type is None else module_type
    base = _registered_base(module_type)
    if base is not None:
        return _BY_TYPE[base]
    for room in _MATCHED:
        if room.matches(module, module_type):
            return room
    return _NAMED["generic"]


def norm_samplers(model: nn.Module) -> dict:
    """``{layer type: norm function}`` the hooks use for ``model``, by exact type.

    Typed rooms with a norm of their own, the subclasses in ``model`` that :func:`room_for`
    gives such a room (those Opacus has a sampler of its own for keep it), then the matched
    rooms' types found in ``model`` (see :meth:`types_in` of such a room). Rooms whose norm is
    :class:`Unavailable` leave their types to Opacus's per-sample gradients; a subclass that
    overrides ``forward`` is in no room's table (the generic room's norm, or Opacus's).
    """
    table = {t: room.norm for t, room in _BY_TYPE.items() if room.norm}
    opacus = GradSampleHooksFastGradientClipping
    for module in model.modules():
        t = layer_type(module)
        base = _registered_base(t)
        if (
            base is not None
            and t not in table
            and t not in opacus.NORM_SAMPLERS
            and t not in opacus.GRAD_SAMPLERS
            and _BY_TYPE[base].norm
        ):
            table[t] = _BY_TYPE[base].norm
    for room in _MATCHED:
        if room.norm:
            table.update({t: room.norm for t in room.types_in(model)})
    return table


def layer_type(module: nn.Module) -> type:
    """The layer's own class (FSDP2's ``FSDP<Class>`` mapped back to ``<Class>``)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) > 1:
        return cls.__bases__[1]
    return cls


def refusals(model: nn.Module) -> list[str]:
    """``"name: why"`` for each layer with trainable parameters that its room refuses."""
    out = []
    for name, module in model.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            why = room_for(module, layer_type(module)).refusal(module)
            if why is not None:
                out.append(f"{name or type(module).__name__}: {why}")
    return out
