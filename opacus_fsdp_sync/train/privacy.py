"""What the trainer's DP guarantee covers.

The steps a run takes are decided once (:func:`plan_steps`) and the noise for a target epsilon
is calibrated for exactly those steps (:func:`noise_for_target`), so the accountant never reports
more than the target. What the trainer reports outside the guarantee is named in
:mod:`.disclosure`; which unit of the data the guarantee protects, here (:func:`privacy_unit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opacus.accountants.utils import get_noise_multiplier

from .config import TrainConfig
from .disclosure import NOT_PRIVATE


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """How many logical steps a run takes, and at which sample rate."""

    steps_per_epoch: int
    """Batches of the loader handed to ``make_private``; Opacus samples at its inverse."""
    total_steps: int
    """Logical steps the trainer runs; the noise is calibrated for this many."""

    @property
    def sample_rate(self) -> float:
        """Poisson sample rate ``q``, as Opacus computes it (``1 / len(data_loader)``)."""
        return 1 / self.steps_per_epoch


def plan_steps(*, steps_per_epoch: int, epochs: float, max_steps: int | None) -> StepPlan:
    """The run's logical steps: ``epochs x steps_per_epoch`` rounded down, at most ``max_steps``.

    The product is rounded to 6 decimals before it is rounded down, so that ``0.29 x 100`` is
    29 steps, not the 28 that float arithmetic gives. Whatever the rounding, the trainer runs
    this count and calibrates its noise for this count.

    Args:
        steps_per_epoch: ``len(data_loader)`` of the loader given to ``make_private``.
        epochs: Passes over the training set (fractions allowed).
        max_steps: A cap on the steps (None: none).

    Returns:
        The plan.

    Raises:
        ValueError: if the run would take no step.
    """
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch}: the training set is empty")
    total = math.floor(round(epochs * steps_per_epoch, 6))
    if max_steps is not None:
        total = min(total, max_steps)
    if total < 1:
        raise ValueError(
            f"epochs={epochs} x {steps_per_epoch} steps per epoch (max_steps={max_steps}) "
            "makes no step: raise epochs or max_steps"
        )
    return StepPlan(steps_per_epoch=steps_per_epoch, total_steps=total)


def noise_for_target(
    *, target_epsilon: float, delta: float, plan: StepPlan, accountant: str
) -> float:
    """The noise multiplier whose epsilon after ``plan.total_steps`` steps is at most the target.

    Opacus's binary search (``get_noise_multiplier``) on the given steps, instead of the
    ``int(epochs / sample_rate)`` that ``make_private_with_epsilon`` derives from epochs, which
    float rounding can put one step below the steps run.

    Args:
        target_epsilon: The epsilon not to exceed.
        delta: The DP delta.
        plan: The run's steps and sample rate.
        accountant: The engine's accountant mechanism (``"prv"``, ``"rdp"``, ``"gdp"``).

    Returns:
        The noise multiplier (its epsilon lies within Opacus's search tolerance, 0.01, below
        the target).
    """
    return get_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=delta,
        sample_rate=plan.sample_rate,
        steps=plan.total_steps,
        accountant=accountant,
    )


def privacy_unit(cfg: TrainConfig) -> str:
    """What one unit of privacy is for this run's data: what the guarantee protects.

    Args:
        cfg: The run's configuration (``data`` and ``task`` decide).

    Returns:
        A phrase naming the unit.
    """
    if cfg.data is None:
        return "one example (one sequence) of the built-in synthetic task"
    return (
        f"one record of {cfg.data} (one example, cut or padded to {cfg.seq_length} tokens, "
        "never concatenated with another record)"
    )


def guarantee(
    cfg: TrainConfig, *, epsilon: float, accountant: str, noise: float, plan: StepPlan, steps: int
) -> dict:
    """The privacy record of a run, for ``summary.json`` and each export's ``privacy.json``.

    Args:
        cfg: The run's configuration.
        epsilon: The accountant's epsilon at ``cfg.delta`` after ``steps`` (inf without noise).
        accountant: The accountant's mechanism (``"prv"``, ``"rdp"``, ``"gdp"``).
        noise: The noise multiplier (sigma).
        plan: The run's steps and sample rate.
        steps: Logical steps taken (and counted by the accountant) so far.

    Returns:
        A JSON-ready dict.
    """
    return {
        "accountant": accountant,
        "epsilon": epsilon,
        "delta": cfg.delta,
        "sample_rate": plan.sample_rate,
        "steps": steps,
        "noise_multiplier": noise,
        "max_grad_norm": cfg.max_grad_norm,
        "poisson_sampling": cfg.poisson_sampling,
        "privacy_unit": privacy_unit(cfg),
        "secure_mode": False,
        "dp_seed_given": cfg.dp_seed is not None,
        "not_private": NOT_PRIVATE,
    }
