"""The DP arguments a Hugging Face ``Trainer`` adds: one small, validated dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class DPArguments:
    """What DP fine-tuning needs beyond ``TrainingArguments``.

    Give exactly one of ``target_epsilon`` (the noise is calibrated for the steps the run
    takes) and ``noise_multiplier``.
    """

    target_epsilon: float | None = None
    """Epsilon at ``delta`` after the run's steps (``max_steps``, or epochs x steps per epoch);
    the noise multiplier is the smallest that keeps the accountant at or below it."""
    noise_multiplier: float | None = None
    """The noise multiplier sigma, given instead of ``target_epsilon`` (0: no noise, no
    privacy; the reported epsilon is then infinite)."""
    delta: float = 1e-5
    """The DP delta; keep it below 1 / the number of training examples."""
    max_grad_norm: float = 1.0
    """Per-example clipping bound C (flat clipping over every trainable parameter). The
    Trainer's own ``max_grad_norm`` (global clipping) is turned off."""
    logical_batch_size: int | None = None
    """Expected global batch of one optimizer step (Poisson sampling: each example joins with
    probability q = 1 / ceil(N / logical_batch_size)). None: ``per_device_train_batch_size x
    gradient_accumulation_steps x data-parallel ranks``."""
    max_physical_batch_size: int | None = None
    """Most examples one rank puts through one forward/backward (the memory manager's limit);
    a logical batch runs as several physical batches, one optimizer step. None:
    ``per_device_train_batch_size``."""
    accountant: str = "prv"
    """Opacus's accountant (``prv``, ``rdp``, ``gdp``); the one the logs and the end report."""
    dp_seed: int | None = None
    """None (the default): the Poisson draws and the noise come from OS entropy. An integer
    opts in to reproducible DP randomness (tests, debugging): privacy then rests on it staying
    secret. ``TrainingArguments.seed`` never decides DP randomness."""
    fresh_noise: bool = False
    """With ``resume_from_checkpoint``: restart every noise generator from OS entropy, count
    every step the run that saved the checkpoint took after it (its draw ledger in
    ``output_dir``, or ``steps_after_checkpoint``) and draw new batches. For a run whose outputs
    after the checkpoint (a later checkpoint's model, metrics) may have been seen."""
    steps_after_checkpoint: int | None = None
    """With ``fresh_noise``, where the draw ledger is lost: the steps the earlier run took after
    the checkpoint (an over-count costs budget, never privacy)."""

    def __post_init__(self) -> None:
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "DPArguments: give exactly one of target_epsilon and noise_multiplier (got "
                f"target_epsilon={self.target_epsilon}, noise_multiplier={self.noise_multiplier})"
            )
        if self.target_epsilon is not None and not (
            self.target_epsilon > 0 and math.isfinite(self.target_epsilon)
        ):
            raise ValueError(f"target_epsilon={self.target_epsilon}: must be positive and finite")
        if self.noise_multiplier is not None and self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier={self.noise_multiplier}: must be >= 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta={self.delta}: must be in (0, 1)")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm}: must be positive")
        for name, value in (
            ("logical_batch_size", self.logical_batch_size),
            ("max_physical_batch_size", self.max_physical_batch_size),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be a positive integer or None")
        if self.steps_after_checkpoint is not None and (
            self.steps_after_checkpoint < 0 or not self.fresh_noise
        ):
            raise ValueError(
                f"steps_after_checkpoint={self.steps_after_checkpoint}: give a count >= 0, "
                "with fresh_noise=True"
            )
        if self.accountant not in ("prv", "rdp", "gdp"):
            raise ValueError(f"accountant={self.accountant!r}: choose 'prv', 'rdp' or 'gdp'")
