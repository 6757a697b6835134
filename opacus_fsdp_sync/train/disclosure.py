"""What the trainer writes outside the DP guarantee: named for ``--help``, the log and the summary.

The (epsilon, delta) guarantee covers the trained weights. Everything else a run reports (losses,
batch sizes, timings, checkpoints) is listed here with the reason it is not private, so the
command line, the start-up log and ``summary.json`` say the same.
"""

from __future__ import annotations

#: What the trainer reports or writes outside the (epsilon, delta) guarantee, by the name it
#: has in ``metrics.jsonl``, ``summary.json`` or ``--out``, and why.
NOT_PRIVATE: dict[str, str] = {
    "train_loss": "un-noised loss on the private training examples (also the progress bar's)",
    "heldout_loss": "un-noised loss on the held-out split, drawn from the same private data",
    "examples_seen": "the realized Poisson batch sizes, which depend on who is in the data",
    "step_ms": "step times (and the progress bar's tokens/s), which follow the batch sizes",
    "wall_s": "the run's wall time, which follows the batch sizes",
    "metrics.png": "plots train_loss and heldout_loss",
    "checkpoints": "the sampler's seed and the noise generators' states: the DP randomness",
}

#: For ``--help``, the start-up log and the README.
PRIVACY_NOTE = (
    "Not private (outside the (epsilon, delta) guarantee, which covers the trained weights): "
    "the train loss (metrics.jsonl, progress bar, metrics.png) and the held-out loss (also in "
    "summary.json; the held-out split comes from the same private data) are computed without "
    "noise; examples_seen and the timings follow the realized Poisson batch sizes; checkpoints "
    "hold the sampler's seed and the noise generators' states. Keep all of them as private as "
    "the data. Privacy unit: one example of the synthetic task; with --data, one record (a line "
    "of .txt, a JSON line, a data set row), which is one example, never concatenated with "
    "another."
)
