"""What the trainer's DP guarantee covers.

The steps a run takes are decided once (:func:`plan_steps`) and the noise for a target epsilon
is calibrated for exactly those steps (:func:`noise_for_target`), so the accountant never reports
more than the target. What the trainer reports outside the guarantee is named in
:mod:`.disclosure`; which unit of the data the guarantee protects, here (:func:`privacy_unit`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from opacus.accountants.utils import get_noise_multiplier

from .config import TrainConfig
from .disclosure import NOT_PRIVATE

logger = logging.getLogger(__name__)


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
    cfg: TrainConfig,
    *,
    epsilon: float,
    accountant: str,
    noise: float,
    plan: StepPlan,
    steps: int,
    history: list,
) -> dict:
    """The privacy record of a run, for ``summary.json`` and each export's ``privacy.json``.

    Args:
        cfg: The run's configuration.
        epsilon: The accountant's epsilon at ``cfg.delta`` after ``steps`` (inf without noise).
        accountant: The accountant's mechanism (``"prv"``, ``"rdp"``, ``"gdp"``).
        noise: The noise multiplier (sigma).
        plan: The run's steps and sample rate.
        steps: Logical steps taken (and counted by the accountant) so far.
        history: The accountant's ``[sigma, q, steps]`` entries, the releases an ``--init-from``
            export carried first.

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
        "init_from": cfg.init_from,
        "history": history,
        "not_private": NOT_PRIVATE,
    }


def prior_history(init_from: str | None) -> list[tuple[float, float, int]]:
    """The releases the weights ``--init-from`` names already carry, from their privacy record.

    The record is the export's ``privacy.json`` (an adapter's is one folder up). Counting them
    again is exact when the earlier run trained on the same records, and an upper bound
    otherwise: a run continuing from private weights never reports less than they carry.

    Args:
        init_from: The ``--init-from`` path (None: none).

    Returns:
        ``(sigma, sample rate, steps)`` entries; empty without a record.

    Raises:
        ValueError: for a record with steps taken without noise (no guarantee to build on).
    """
    if init_from is None:
        return []
    paths = [Path(init_from) / "privacy.json", Path(init_from).parent / "privacy.json"]
    found = next((p for p in paths if p.is_file()), None)
    if found is None:
        return []
    record = json.loads(found.read_text())
    entries = record.get("history") or [
        [record["noise_multiplier"], record["sample_rate"], record["steps"]]
    ]
    entries = [(float(s), float(q), int(n)) for s, q, n in entries if int(n) > 0]
    if any(s <= 0 for s, _, _ in entries):
        raise ValueError(
            f"--init-from {init_from}: {found} records steps taken without noise (epsilon "
            f"{record.get('epsilon')}): those weights carry no DP guarantee to build on. Start "
            "from the base model (--model-path, or the preset) instead."
        )
    return entries


def count_prior_releases(engine, entries: list[tuple[float, float, int]], rank: int) -> None:
    """Puts the releases an ``--init-from`` export carried into the accountant's history.

    Args:
        engine: The run's privacy engine (before its first step).
        entries: :func:`prior_history`.
        rank: This process's rank (rank 0 logs).
    """
    if not entries:
        return
    engine.accountant.history.extend(entries)
    if rank == 0:
        logger.warning(
            "[Ghost] --init-from carries %d private step(s) already (its privacy.json): the "
            "accountant counts them, so epsilon covers both runs (exact on the same records, "
            "an upper bound on others)",
            sum(n for _, _, n in entries),
        )
