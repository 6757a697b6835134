"""Sharded checkpoints of model and optimizer through ``torch.distributed.checkpoint``.

Every rank writes its own shards; loading re-shards onto any world size. Opacus wrappers are
looked through: pass the GradSampleModule or the model, the DPOptimizer or the optimizer. Given
the engine too, the checkpoint also carries the DP state (accountant, noise generators, sampler,
settings; see :mod:`.dp_state`), so that a resumed run continues as if it had never stopped.
"""

from __future__ import annotations

import os

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from ..distributed.detect import _unwrap
from . import dp_state as state_module
from . import resume_position as positions


def _targets(model, optimizer):
    module = _unwrap(model)
    optim = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
    return module, optim


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    engine=None,
    ledger_folder: str | None = None,
):
    """Saves model (and optimizer) state under directory ``path``; every rank calls it.

    Args:
        path: Checkpoint directory (created).
        model: The model, or Opacus's wrapper of it.
        optimizer: The (DP) optimizer, or None for the model only.
        engine: Our ``PrivacyEngine``: also saves each rank's DP state (needs ``optimizer``, the
            DP optimizer ``make_private`` returned). The state holds the sampler's secret seed
            and the noise generators' states: keep such checkpoints as private as the data.
        ledger_folder: Where the run's draw ledger lives (:mod:`..sampling.ledger`), for a
            framework that deletes old checkpoint folders (Hugging Face's
            ``save_total_limit``); None: beside ``path``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    module, optim = _targets(model, optimizer)
    if optim is None:
        state = {"model": get_model_state_dict(module)}
    else:
        msd, osd = get_state_dict(module, optim)
        state = {"model": msd, "optim": osd}
    dcp.save(state, checkpoint_id=path)
    if engine is not None:
        if optimizer is None:
            raise ValueError("save_checkpoint(engine=...) needs the DP optimizer too")
        os.makedirs(path, exist_ok=True)
        positions.start_ledger(engine, path, ledger_folder)
        dp = state_module.dp_state(engine, optimizer)
        dp["optimizer_steps"] = engine.optimizer_steps
        torch.save(dp, state_module.dp_state_path(path, dp["rank"]))


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    engine=None,
    fresh_noise: bool = False,
    steps_after_checkpoint: int | None = None,
    ledger_folder: str | None = None,
):
    """Loads what :func:`save_checkpoint` wrote, on any world size; every rank calls it.

    Args:
        path: Checkpoint directory.
        model: The model, or Opacus's wrapper of it.
        optimizer: The (DP) optimizer, or None for the model only.
        engine: Our ``PrivacyEngine`` after ``make_private`` with the saved run's settings: also
            restores the DP state (accountant, noise generators, sampler) and the engine's
            ``optimizer_steps``.
        fresh_noise: Restore accountant and sampler and restart every noise generator from OS
            entropy: on another layout (world size, API, mesh, placements) instead of refusing,
            or on the saved one when outputs computed after the checkpoint may have been seen
            (see :mod:`.dp_state`). Every step the earlier run took after this checkpoint is
            counted and new batches are drawn for the steps taken again: how far it went comes
            from the draw ledger beside the checkpoint (``dp_draws_*.json``), or from
            ``steps_after_checkpoint``.
        steps_after_checkpoint: The steps the run that saved this checkpoint took after it,
            for a ``fresh_noise`` resume whose ledger is lost (an over-count is safe).
        ledger_folder: As :func:`save_checkpoint`'s: where the run's draw ledger goes on, its
            furthest position copied there when the loaded one lives elsewhere (inside a
            Hugging Face ``checkpoint-N`` folder, where earlier releases kept it); None: where
            it is.

    Raises:
        CheckpointMismatchError: the DP state is missing or belongs to another configuration,
            or ``fresh_noise`` cannot know how far the earlier run went.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    module, optim = _targets(model, optimizer)
    dp = None if engine is None else _read_dp_state(path, optimizer)
    resume_at = None
    if dp is not None:  # refused before anything is loaded
        state_module.check_dp_state(dp, engine, optimizer, fresh_noise=fresh_noise)
        resume_at = positions.resume_position(
            dp, path, fresh_noise=fresh_noise, steps_after_checkpoint=steps_after_checkpoint
        )
    if optim is None:
        state = {"model": get_model_state_dict(module)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(module, state["model"])
        return
    msd, osd = get_state_dict(module, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if dp is not None:
        state_module.restore_dp_state(
            dp,
            engine,
            optimizer,
            fresh_noise=fresh_noise,
            resume_at=resume_at,
            ledger=positions.ledger_file(dp, path),
        )
        if ledger_folder is not None:
            positions.move_ledger(engine, ledger_folder)
        # steps taken before the checkpoint (absent from checkpoints of earlier releases)
        engine.optimizer_steps = dp.get("optimizer_steps", engine.optimizer_steps)


def _read_dp_state(path: str, optimizer) -> dict:
    """This rank's saved DP state (rank 0's when the world size changed)."""
    if optimizer is None:
        raise ValueError("load_checkpoint(engine=...) needs the DP optimizer too")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    first = state_module.dp_state_path(path, 0)
    if not os.path.exists(first):
        raise state_module.CheckpointMismatchError(
            f"{path} holds no DP state (no {os.path.basename(first)}): it was saved without "
            "engine=..., so the accountant, noise and sampler cannot be restored. Resume from a "
            "checkpoint saved with save_checkpoint(path, model, optimizer, engine=engine)."
        )
    dp = torch.load(first, weights_only=False)
    own = state_module.dp_state_path(path, rank)
    if rank != 0 and os.path.exists(own):
        dp = torch.load(own, weights_only=False)
    return dp
