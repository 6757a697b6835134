"""Sharded checkpoints of model and optimizer through ``torch.distributed.checkpoint``.

Every rank writes its own shards; loading re-shards onto any world size. Opacus wrappers are
looked through: pass the GradSampleModule or the model, the DPOptimizer or the optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.detect import _unwrap


def _targets(model, optimizer):
    module = _unwrap(model)
    optim = getattr(optimizer, "original_optimizer", optimizer)
    return module, optim


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Saves model (and optimizer) state under directory ``path``; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    module, optim = _targets(model, optimizer)
    if optim is None:
        state = {"model": get_model_state_dict(module)}
    else:
        msd, osd = get_state_dict(module, optim)
        state = {"model": msd, "optim": osd}
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Loads what :func:`save_checkpoint` wrote, on any world size; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    module, optim = _targets(model, optimizer)
    if optim is None:
        state = {"model": get_model_state_dict(module)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(module, state["model"])
        return
    msd, osd = get_state_dict(module, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
