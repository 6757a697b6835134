"""The record of every distributed API, and detection that returns a model's record."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from ..distributed.detect import _get_fsdp_root_module
from . import ddp, fsdp1, fsdp2, single, tp
from .api import GHOST_ALIASES, ApiRecord

logger = logging.getLogger("opacus_fsdp_sync")

#: Every API's record, by name (None: single device). A new API adds its module's record here.
RECORDS: dict[str | None, ApiRecord] = {
    record.name: record
    for record in (single.RECORD, ddp.RECORD, fsdp1.RECORD, fsdp2.RECORD, tp.RECORD)
}


def record_for(name: str | None) -> ApiRecord:
    """The record of API ``name`` (None: single device).

    Raises:
        KeyError: naming the known APIs, for an unknown name.
    """
    try:
        return RECORDS[name]
    except KeyError:
        known = sorted(map(str, RECORDS))
        raise KeyError(f"unknown distributed API {name!r}; known: {known}") from None


@dataclass(frozen=True)
class Detected:
    """A model's distributed API and the modules its record controls."""

    record: ApiRecord
    modules: list[nn.Module]
    """The outermost wrapped modules (FSDP2 units, the FSDP1 root, the DDP module)."""


def detect_api(module: object) -> Detected:
    """The record of the API that wraps ``module`` (a model, or Opacus's wrapper of one)."""
    root = _get_fsdp_root_module(module)
    return Detected(record_for(root.api), root.modules)


def resolve_ghost_mode(mode: str, module: object) -> str:
    """The ``grad_sample_mode`` this package runs for ``mode`` on ``module``.

    An alias of :data:`~.api.GHOST_ALIASES` (``ghost_tp``) becomes the ghost mode of the
    model's API (``ghost`` on one device and DDP, ``ghost_fsdp`` under FSDP and tensor
    parallelism); any other mode is returned unchanged.
    """
    if mode not in GHOST_ALIASES:
        return mode
    resolved = detect_api(module).record.capabilities.ghost_modes[0]
    logger.info("[Ghost] grad_sample_mode=%r runs as %r on this model", mode, resolved)
    return resolved
