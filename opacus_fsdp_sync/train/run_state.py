"""What a trainer checkpoint carries beside the model, optimizer and DP state.

The learning-rate schedule's state, the examples seen so far over all ranks and the wall time
spent up to the checkpoint (so that a resumed run's report covers the whole run); and on resume
``metrics.jsonl`` cut back to the checkpoint's step, so that each step appears once; and the
retention of ``--keep-last`` checkpoints.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

_FILE = "trainer_state.pt"


def save_run_state(path: Path, *, scheduler, examples_seen: int, wall_s: float) -> None:
    """Rank 0 writes the trainer's state into checkpoint directory ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    state = {"scheduler": scheduler.state_dict(), "examples_seen": examples_seen, "wall_s": wall_s}
    torch.save(state, path / _FILE)


def load_run_state(path: Path, *, scheduler) -> dict:
    """Restores the schedule from checkpoint directory ``path``; returns the saved counters.

    Raises:
        FileNotFoundError: for a checkpoint without the trainer's state.
    """
    state = torch.load(path / _FILE, weights_only=True)
    scheduler.load_state_dict(state["scheduler"])
    return state


def truncate_metrics(metrics: Path, step: int) -> int:
    """Drops the rows of ``metrics`` logged after ``step``; returns how many were dropped."""
    if not metrics.exists():
        return 0
    rows = [line for line in metrics.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= step]
    metrics.write_text("".join(line + "\n" for line in kept))
    return len(rows) - len(kept)


_STEP_DIR = re.compile(r"step(\d+)")


def checkpoint_step(path: Path) -> int | None:
    """The logical step a checkpoint directory ``stepNNNNNN`` was saved at (None: another name)."""
    match = _STEP_DIR.fullmatch(path.name)
    return None if match is None else int(match.group(1))


def prune_checkpoints(checkpoints: Path, keep: int) -> list[Path]:
    """Deletes all but the ``keep`` newest checkpoints up to the one ``latest`` names.

    Called by rank 0 after a save has completed and ``latest`` names it, so the marker always
    names a checkpoint that exists. Directories of steps after ``latest`` (left by a run that died
    before it could mark them, and written again as a resumed run reaches them) are not touched.

    Args:
        checkpoints: the ``out/checkpoints`` directory (``stepNNNNNN/`` and ``latest``).
        keep: how many to keep, ``latest`` included; 0 keeps all.

    Returns:
        The checkpoint directories kept, oldest first.
    """
    latest = (checkpoints / "latest").read_text().strip()
    latest_step = int(_STEP_DIR.fullmatch(latest).group(1))
    steps = sorted(
        (int(m.group(1)), p)
        for p in checkpoints.iterdir()
        if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)) and int(m.group(1)) <= latest_step
    )
    dropped = steps[: max(len(steps) - keep, 0)] if keep > 0 else []
    for _, path in dropped:
        shutil.rmtree(path)
    return [path for _, path in steps[len(dropped) :]]
