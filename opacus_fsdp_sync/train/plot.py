"""The trainer's plot: train and held-out loss, and epsilon, against the logical step."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_metrics(metrics: Path, png: Path) -> None:
    """Writes ``png`` from the trainer's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    fig, (ax_loss, ax_eps) = plt.subplots(1, 2, figsize=(10, 3.8))
    trained = [r for r in rows if "train_loss" in r]
    ax_loss.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], label="train")
    held = [r for r in rows if "heldout_loss" in r]
    ax_loss.plot(
        [r["step"] for r in held], [r["heldout_loss"] for r in held], "o-", label="held-out"
    )
    ax_loss.set(xlabel="logical step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_eps.plot([r["step"] for r in held], [r["epsilon"] for r in held], "o-", color="C2")
    ax_eps.set(xlabel="logical step", ylabel="epsilon", title="privacy spent")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
