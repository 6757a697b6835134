"""Making a Trainer's prepared model private: the engine, its optimizer, criterion and draws.

Called once the Trainer (and accelerate) have placed and wrapped the model: the plain model on
one device, accelerate's ``DistributedDataParallel``, or a model the user sharded with
``fully_shard`` (FSDP2) or that accelerate's FSDP2 plugin sharded. The ghost-clipping mode
comes from the detected API; the noise for a target epsilon is calibrated for exactly the
steps the Trainer will take, at the sample rate the shared Poisson sampler draws with.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from opacus.accountants.utils import get_noise_multiplier
from torch import nn
from torch.utils.data import DataLoader

from ...apis.registry import detect_api
from ...privacy_engine import PrivacyEngine
from ...sampling.poisson import SharedPoissonSampler
from .arguments import DPArguments

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DPSession:
    """What ``make_private`` returned for one Trainer run, and the privacy parameters."""

    engine: PrivacyEngine
    """The engine (its accountant counts every draw as it is handed out)."""
    module: nn.Module
    """The model wrapped for ghost clipping (what the training step calls)."""
    optimizer: torch.optim.Optimizer
    """The DP optimizer (clipped sums, noise, one step per logical batch)."""
    criterion: nn.Module
    """The per-example criterion; its losses' ``backward()`` runs the private step."""
    sampler: SharedPoissonSampler
    """The shared Poisson sampler (one global draw per logical step)."""
    noise_multiplier: float
    """Sigma."""
    sample_rate: float
    """Poisson sample rate q = 1 / steps per epoch."""
    total_steps: int
    """The Trainer's ``max_steps``; a target epsilon is calibrated for this many."""
    dp: DPArguments
    """The run's DP arguments."""

    def epsilon(self) -> float:
        """The engine's accountant's epsilon at ``dp.delta`` for the draws counted so far.

        Infinite without noise; 0 before the first draw.
        """
        if self.noise_multiplier == 0:
            return math.inf
        if not self.engine.accountant.history:
            return 0.0
        return float(self.engine.get_epsilon(self.dp.delta))

    @property
    def steps_counted(self) -> int:
        """Draws the accountant counted (every draw handed out, step or not)."""
        return sum(entry[-1] for entry in self.engine.accountant.history)

    def record(self) -> dict:
        """The privacy record of the run so far (``privacy.json`` beside each saved model)."""
        return {
            "accountant": self.engine.accountant.mechanism(),
            "epsilon": self.epsilon(),
            "delta": self.dp.delta,
            "sample_rate": self.sample_rate,
            "steps": self.steps_counted,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.dp.max_grad_norm,
            "poisson_sampling": True,
            "privacy_unit": "one training record (one example, never concatenated with another)",
            "dp_seed_given": self.dp.dp_seed is not None,
            "not_private": NOT_PRIVATE,
        }


#: What a DP Trainer reports outside the (epsilon, delta) guarantee, and why.
NOT_PRIVATE: dict[str, str] = {
    "loss": "the logged train loss is computed without noise on the private examples",
    "eval_loss": "evaluation metrics, when the evaluation set comes from private data",
    "num_input_tokens_seen": "follows the realized Poisson batch sizes",
    "train_runtime": "timings follow the realized Poisson batch sizes",
    "checkpoints": "hold the sampler's seed and the noise generators' states: the DP randomness",
}


def calibrate_noise(dp: DPArguments, *, sample_rate: float, steps: int) -> float:
    """Sigma for the run: the given one, or the smallest meeting ``target_epsilon`` after ``steps``.

    Args:
        dp: The DP arguments.
        sample_rate: The Poisson sample rate q.
        steps: Logical steps the run takes (the Trainer's ``max_steps``).

    Returns:
        The noise multiplier.
    """
    if dp.noise_multiplier is not None:
        return dp.noise_multiplier
    return get_noise_multiplier(
        target_epsilon=dp.target_epsilon,
        target_delta=dp.delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=dp.accountant,
    )


def make_session(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    dp: DPArguments,
    total_steps: int,
) -> DPSession:
    """Makes the prepared model private.

    Collective: every rank calls it (the sampler's and the noise's seeds are broadcast).

    Args:
        model: The model as the Trainer prepared it (plain, DDP, or FSDP2-sharded).
        optimizer: The torch optimizer (accelerate's wrapper removed).
        data_loader: A loader over the training set whose ``len()`` is the steps per epoch
            (its batch size is the logical batch).
        dp: The DP arguments.
        total_steps: The steps the Trainer will take.

    Returns:
        The session.
    """
    sample_rate = 1 / len(data_loader)
    noise = calibrate_noise(dp, sample_rate=sample_rate, steps=total_steps)
    engine = PrivacyEngine(accountant=dp.accountant, dp_seed=dp.dp_seed)
    mode = detect_api(model).record.capabilities.ghost_modes[0]
    module, dp_optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        data_loader=data_loader,
        noise_multiplier=noise,
        max_grad_norm=dp.max_grad_norm,
        poisson_sampling=True,
        grad_sample_mode=mode,
    )
    sampler = loader.batch_sampler
    if not isinstance(sampler, SharedPoissonSampler):  # the engine's rule for ghost modes
        raise RuntimeError(f"expected the shared Poisson sampler, got {type(sampler).__name__}")
    logger.info(
        "[Ghost] DP trainer: %s, noise %.6g, C %g, q = %.6g, %d steps%s",
        mode,
        noise,
        dp.max_grad_norm,
        sample_rate,
        total_steps,
        ""
        if dp.target_epsilon is None
        else f" (calibrated for epsilon {dp.target_epsilon} at delta {dp.delta})",
    )
    return DPSession(
        engine=engine,
        module=module,
        optimizer=dp_optimizer,
        criterion=criterion,
        sampler=sampler,
        noise_multiplier=noise,
        sample_rate=sample_rate,
        total_steps=total_steps,
        dp=dp,
    )
