"""What a trainer checkpoint carries beside the model, optimizer and DP state.

The learning-rate schedule's state, the examples seen so far over all ranks and the wall time
spent up to the checkpoint (so that a resumed run's report covers the whole run); and on resume
``metrics.jsonl`` cut back to the checkpoint's step, so that each step appears once.
"""

from __future__ import annotations

import json
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
