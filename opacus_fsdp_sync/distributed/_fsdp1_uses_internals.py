"""Which FSDP1 original parameter a node of the autograd graph reads (the parameter-use check).

Under FSDP1 with ``use_orig_params=True`` the forward never reads an original parameter itself:
each handle's flat parameter is split into pieces, the alignment padding included, and each
piece viewed to its parameter's shape (torch's ``FlatParamHandle._get_unflat_views_aligned``);
that view is set on the owning module, and on every module sharing the parameter. In the graph
one use of the parameter is one edge into that view's node, whose only input is output ``i`` of
the split, whose only input is the flat parameter's ``AccumulateGrad``. The flat parameter
keeps, for each piece that is not padding, the owner module and name (``_param_infos``), the
original parameter (``_params``) and the modules sharing it (``_shared_param_infos``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import version_gate
from ._fsdp1_internals import handles
from ._fsdp2_internals import FSDPInternalsError

#: The autograd nodes of a piece's view (``view``, or ``as_strided`` for a non-contiguous
#: parameter) and of the flat parameter's split, as on torch 2.13 and 2.15.
_VIEWS, _SPLIT = frozenset({"ViewBackward0", "AsStridedBackward0"}), "SplitWithSizesBackward0"
#: The attribute an FSDP1 instance keeps the module it wraps under (a segment of every name).
_WRAPPED = "_fsdp_wrapped_module"


def _fail(what: str) -> FSDPInternalsError:
    return version_gate.internals_error(
        "the parameter-use check under FSDP1",
        what,
        "Use FSDP2 (fully_shard), or install a tested torch release.",
        cls=FSDPInternalsError,
    )


@dataclass(frozen=True)
class FlatPiece:
    """One original parameter inside an FSDP1 flat parameter."""

    name: str
    """Its qualified name in the model, without FSDP1's wrapper segments."""
    param: nn.Parameter
    """The original parameter (its ``requires_grad`` is the user's)."""
    owners: tuple[nn.Module, ...]
    """The modules holding it: the owner, then the modules sharing it."""
    aliases: tuple[nn.Parameter, ...] = ()
    """The parameter objects the sharing modules register for it."""


def _field(flat, name: str):
    value = getattr(flat, name, None)
    if value is None:
        raise _fail(f"FlatParameter.{name}")
    return value


def module_names(model: nn.Module) -> dict[int, str]:
    """Qualified module names as the user wrote them.

    Args:
        model: The model, FSDP1-wrapped or not.

    Returns:
        ``{id(module): qualified name}``, without FSDP1's ``_fsdp_wrapped_module`` segments.
    """
    return {
        id(m): ".".join(part for part in n.split(".") if part != _WRAPPED)
        for n, m in model.named_modules()
    }


def flat_pieces(model: nn.Module) -> dict[int, dict[int, FlatPiece]]:
    """``{id(flat parameter): {split output index: piece}}`` for every FSDP1 handle in ``model``.

    Padding pieces have no entry. Empty for a model without FSDP1. Reads ``FlatParameter``'s
    ``_param_infos``, ``_params``, ``_is_padding_mask``, ``_shared_param_infos`` and
    ``_shared_params`` (as on torch 2.13 and 2.15).

    Args:
        model: The model the hooks wrap.

    Returns:
        The pieces of each flat parameter.

    Raises:
        FSDPInternalsError: when a flat parameter lacks what the map is built from.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not any(isinstance(m, FSDP) for m in model.modules()):
        return {}
    qualified = module_names(model)
    out: dict[int, dict[int, FlatPiece]] = {}
    for handle in handles(model):
        flat = handle.flat_param
        infos, params = _field(flat, "_param_infos"), _field(flat, "_params")
        padding, shared = _field(flat, "_is_padding_mask"), _field(flat, "_shared_param_infos")
        if len(infos) != len(params) or sum(not p for p in padding) != len(params):
            raise _fail("FlatParameter._param_infos, _params and _is_padding_mask of one length")
        shared_params = _field(flat, "_shared_params")
        if len(shared_params) != len(shared):
            raise _fail("FlatParameter._shared_params and _shared_param_infos of one length")
        sharing: dict[tuple[int, str], list[tuple[nn.Module, nn.Parameter]]] = {}
        for (_, module, _, prim_name, prim_module, _), alias in zip(shared, shared_params):
            sharing.setdefault((id(prim_module), prim_name), []).append((module, alias))
        split_index = [i for i, pad in enumerate(padding) if not pad]
        pieces = {}
        for i, (name, module, _), param in zip(split_index, infos, params, strict=True):
            prefix = qualified.get(id(module), "?")
            others = sharing.get((id(module), name), [])
            pieces[i] = FlatPiece(
                name=f"{prefix}.{name}".lstrip("."),
                param=param,
                owners=(module, *(m for m, _ in others)),
                aliases=tuple(a for _, a in others),
            )
        out[id(flat)] = pieces
    return out


def piece_keys(flats: dict[int, dict[int, FlatPiece]]) -> dict[int, tuple[int, int]]:
    """``{id(original parameter or alias): (id(flat parameter), split index)}``.

    A module holds its original parameter itself (full data under ``NO_SHARD``) until its
    unit's forward sets the view; a read of it then reaches the parameter's own
    ``AccumulateGrad``, and counts as a read of its piece.

    Args:
        flats: :func:`flat_pieces` of the model.

    Returns:
        The key of each original parameter's piece.
    """
    return {
        id(p): (flat, index)
        for flat, pieces in flats.items()
        for index, piece in pieces.items()
        for p in (piece.param, *piece.aliases)
    }


def piece_read(node, flats: dict[int, dict[int, FlatPiece]]) -> tuple[int, int] | None:
    """Which piece of which flat parameter ``node`` views, if it is such a view.

    Args:
        node: An autograd node.
        flats: :func:`flat_pieces` of the model.

    Returns:
        ``(id(flat parameter), split index)``, or None for any other node.
    """
    if type(node).__name__ not in _VIEWS:
        return None
    inputs = node.next_functions
    if len(inputs) != 1 or inputs[0][0] is None:
        return None
    split, index = inputs[0]
    if type(split).__name__ != _SPLIT:
        return None
    below = split.next_functions
    if len(below) != 1 or below[0][0] is None:
        return None
    leaf = getattr(below[0][0], "variable", None)
    if leaf is None or id(leaf) not in flats:
        return None
    return id(leaf), index


def unrecognized_reads(reached: set[int], flats: dict[int, dict[int, FlatPiece]]) -> None:
    """Fails loudly when the graph reached a flat parameter other than through a piece's view.

    Args:
        reached: ``id`` of every leaf the walk reached directly.
        flats: :func:`flat_pieces` of the model.

    Raises:
        FSDPInternalsError: the forward read a flat parameter in a way the check cannot map to
            its original parameters (another torch release may view them differently).
    """
    if reached & flats.keys():
        raise _fail("each original parameter read as a view of one split of its flat parameter")
