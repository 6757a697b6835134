"""Where a resumed run starts: the draw ledger, and how far the run that saved it went.

A checkpoint holds the position of the step it was saved at; the run that saved it may have
gone further before it stopped, and released what it computed there. The draw ledger
(:mod:`..sampling.ledger`), started by the first checkpoint, records that furthest position.
A resume with ``fresh_noise`` counts every step up to it and draws on from there
(:func:`resume_position`); one without warns when the ledger shows such steps, whose draws and
noise it draws again.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from ..randomness import broadcast_seed, os_seed
from ..sampling.ledger import DrawLedger, LedgerPosition, ledger_name, read_ledger
from .dp_state import CheckpointMismatchError, _history, _rank_world

logger = logging.getLogger(__name__)


def start_ledger(engine, checkpoint: str, folder: str | None = None) -> None:
    """Starts ``engine``'s draw ledger in ``folder`` (None: beside directory ``checkpoint``).

    Only where the engine has none yet. Collective (the ledger's id is rank 0's): every rank
    must call it.
    """
    if engine.draw_ledger is None:
        rank, _ = _rank_world()
        lineage = f"{broadcast_seed(os_seed()):016x}"
        if folder is None:
            folder = os.path.dirname(os.path.abspath(checkpoint))
        engine.draw_ledger = DrawLedger(os.path.join(folder, ledger_name(lineage)), write=rank == 0)
    engine.record_progress()


def move_ledger(engine, folder: str) -> None:
    """Carries ``engine``'s draw ledger on in ``folder``, its furthest position copied there.

    For a ledger adopted from a folder a framework may delete (earlier releases kept the Hugging
    Face trainers' inside their first ``checkpoint-N`` folder). Nothing where it is there.
    """
    ledger = engine.draw_ledger
    folder = os.path.abspath(folder)
    if ledger is None or os.path.dirname(os.path.abspath(ledger.path)) == folder:
        return
    moved = DrawLedger(os.path.join(folder, os.path.basename(ledger.path)), write=ledger.write)
    found = read_ledger(ledger.path)
    if found is not None:
        moved.record(found)
    engine.draw_ledger = moved


def ledger_file(state: dict, checkpoint: str) -> str | None:
    """The saved ledger's file (None: no ledger).

    Beside the checkpoint, else one folder up (a framework's run folder that holds its
    checkpoint folders), else where it was written; beside the checkpoint where none exists.
    """
    saved = state.get("ledger")
    if saved is None:
        return None
    name = os.path.basename(saved)
    beside_dir = os.path.dirname(os.path.abspath(checkpoint))
    beside = os.path.join(beside_dir, name)
    for path in (beside, os.path.join(os.path.dirname(beside_dir), name), saved):
        if os.path.exists(path):
            return path
    return beside


def resume_position(
    state: dict, checkpoint: str, *, fresh_noise: bool, steps_after_checkpoint: int | None
) -> LedgerPosition | None:
    """Where a ``fresh_noise`` resume starts: the furthest position of the checkpoint's line.

    A resume with fresh noise is for a run whose outputs after the checkpoint may have been
    seen: it must count every step taken after the checkpoint and draw new batches for the
    steps it takes again. The furthest position comes from the draw ledger beside the
    checkpoint (:mod:`..sampling.ledger`), or from ``steps_after_checkpoint`` (the user's count
    of the steps the earlier run took after saving it), whichever is further. Collective: rank
    0 reads the ledger and every rank gets its answer.

    Returns:
        None without ``fresh_noise`` (the saved position continues); else the position to
        resume at.

    Raises:
        CheckpointMismatchError: with ``fresh_noise`` when neither the ledger nor
            ``steps_after_checkpoint`` says how far the earlier run went.
        ValueError: for a negative ``steps_after_checkpoint``.
    """
    if steps_after_checkpoint is not None and steps_after_checkpoint < 0:
        raise ValueError(f"steps_after_checkpoint must be >= 0, got {steps_after_checkpoint}")
    if not fresh_noise:
        _warn_if_it_went_further(state, checkpoint)
        return None
    rank, world = _rank_world()
    found = None
    if rank == 0:
        path = ledger_file(state, checkpoint)
        found = None if path is None else read_ledger(path)
    if world > 1:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    saved = _saved_position(state)
    candidates = [p for p in (found, saved) if p is not None and p.steps >= saved.steps]
    if steps_after_checkpoint is not None:
        candidates.append(_advanced(saved, steps_after_checkpoint, state))
    if found is None and steps_after_checkpoint is None:
        raise CheckpointMismatchError(
            "fresh_noise=True resumes a run whose outputs after the checkpoint may have been "
            "seen, so it must count every step taken after the checkpoint and draw new batches "
            "for them; but no draw ledger lies beside this checkpoint to say how far that run "
            f"went (looked for {state.get('ledger') or 'a ledger named in the DP state'}). "
            "Pass steps_after_checkpoint=K (the steps the earlier run took after saving it; "
            "an over-count is safe), or put the run's dp_draws_*.json back beside the "
            "checkpoint directory."
        )
    return max(candidates, key=lambda p: (p.steps, p.handed_out or 0))


def _warn_if_it_went_further(state: dict, checkpoint: str) -> None:
    """Warns (rank 0) where the ledger shows the saving run went past ``checkpoint``.

    Resumed without ``fresh_noise``, those steps' draws and noise are drawn again: harmless
    only if nothing computed after the checkpoint was released.
    """
    if _rank_world()[0] != 0:
        return
    path = ledger_file(state, checkpoint)
    found = None if path is None else read_ledger(path)
    beyond = 0 if found is None else found.steps - _saved_position(state).steps
    if beyond > 0:
        logger.warning(
            "[Ghost] the run that saved this checkpoint went %d step(s) further (draw ledger "
            "%s); resumed without fresh_noise, those steps' draws and noise are drawn again. "
            "If anything computed after the checkpoint was released (an exported model, "
            "metrics), resume with fresh_noise=True (the trainer's --fresh-noise; "
            "DPArguments(fresh_noise=True) in the Hugging Face trainers): the accountant "
            "counts those steps and new batches and noise are drawn",
            beyond,
            os.path.basename(path),
        )


def _saved_position(state: dict) -> LedgerPosition:
    sampler = state["sampler"]
    return LedgerPosition(
        handed_out=None if sampler is None else int(sampler["handed_out"]),
        history=[list(entry) for entry in _history(state["accountant"])],
    )


def _advanced(saved: LedgerPosition, steps: int, state: dict) -> LedgerPosition:
    """``saved`` moved on by ``steps`` draws and private steps (the last noise and rate)."""
    if steps == 0:
        return saved
    if saved.history:
        noise, rate = saved.history[-1][0], saved.history[-1][1]
    elif state["sampler"] is not None:
        noise = state["settings"]["noise_multiplier"]
        rate = state["sampler"]["sample_rate"]
    else:
        raise CheckpointMismatchError(
            "steps_after_checkpoint needs the sample rate, which a checkpoint saved before the "
            "first step of Opacus's own loader does not hold: resume without fresh_noise, or "
            "from a later checkpoint."
        )
    history = [list(entry) for entry in saved.history] + [[noise, rate, steps]]
    handed_out = None if saved.handed_out is None else saved.handed_out + steps
    return LedgerPosition(handed_out=handed_out, history=history)
