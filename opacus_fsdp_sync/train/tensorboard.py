"""``--tensorboard``: the metrics rows also as TensorBoard scalars (extra ``[tensorboard]``).

Rank 0 writes ``out/tensorboard/``: ``train/loss``, ``heldout/loss`` and ``privacy/epsilon``
against the logical step, from the rows it writes to ``metrics.jsonl``. Like those rows, the
losses are not private (see ``docs/train.md``).
"""

from __future__ import annotations

from pathlib import Path

#: ``metrics.jsonl`` key -> TensorBoard tag.
TAGS = {"train_loss": "train/loss", "heldout_loss": "heldout/loss", "epsilon": "privacy/epsilon"}


class MetricsWriter:
    """Writes metrics rows as scalars; with ``enabled=False`` (or off rank 0) does nothing."""

    def __init__(self, out: Path, *, enabled: bool) -> None:
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def write(self, row: dict) -> None:
        """One ``metrics.jsonl`` row: each known key at ``row["step"]``."""
        if self._writer is None:
            return
        for key, tag in TAGS.items():
            if key in row:
                self._writer.add_scalar(tag, row[key], global_step=row["step"])
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self._writer is not None:
            self._writer.close()
