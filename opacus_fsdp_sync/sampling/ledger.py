"""How far a run went: a small file, beside its checkpoints, rewritten at every draw and step.

A checkpoint knows the draws and steps taken *before* it was saved. A run that went on after it
(took steps 3 and 4 after saving at step 2, then crashed or was abandoned) may have released
those steps' outputs. A resume that draws the same batches again with new noise
(``fresh_noise=True``) releases the same records twice, and an accountant restored from the
checkpoint would count them once. The draw ledger closes that gap: it holds the furthest
position of the whole line of runs that share the checkpoints (the sampler's draws handed out
and the accountant's history), so that such a resume counts every step taken after the
checkpoint and draws new batches for the steps it takes again.

The ledger is started by the first :func:`~opacus_fsdp_sync.sharding.save_checkpoint` with an
engine (next to the checkpoint directory, ``dp_draws_<id>.json``), named in every checkpoint's
DP state, and adopted by a run that loads one of those checkpoints. Only rank 0 writes it (the
draws and the accountant are global); each write replaces the file atomically and is flushed to
disk, and it never moves backwards.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LedgerPosition:
    """A line of runs' furthest position."""

    #: Draws the shared Poisson sampler handed out (None: Opacus's own loader, no shared draw).
    handed_out: int | None = None
    #: The accountant's history, ``[noise_multiplier, sample_rate, steps]`` per entry.
    history: list[list[float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Private steps the accountant counted."""
        return int(sum(entry[-1] for entry in self.history))

    @classmethod
    def of(cls, accountant, sampler) -> LedgerPosition:
        """The position of a run now: its sampler's draws and its accountant's history."""
        return cls(
            handed_out=None if sampler is None else int(sampler.handed_out),
            history=[[float(n), float(q), int(s)] for n, q, s in accountant.history],
        )


def ledger_name(lineage: str) -> str:
    """The file name of the ledger of line ``lineage`` (a hex id)."""
    return f"dp_draws_{lineage}.json"


class DrawLedger:
    """The furthest position of a line of runs, on disk.

    Args:
        path: The ledger's file.
        write: Whether this process writes it (rank 0 only).
    """

    def __init__(self, path: str, *, write: bool):
        self.path = path
        self.write = write
        saved = read_ledger(path)
        self._furthest = saved.steps if saved is not None else -1

    def record(self, position: LedgerPosition) -> None:
        """Writes ``position`` unless the file already holds one as far (never moves back)."""
        if not self.write or position.steps < self._furthest:
            return
        self._furthest = position.steps
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)  # if removed
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"handed_out": position.handed_out, "history": position.history}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def read_ledger(path: str) -> LedgerPosition | None:
    """The position a ledger file holds (None when there is no such file)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    return LedgerPosition(handed_out=raw["handed_out"], history=raw["history"])
