"""Who counts a private step: each Poisson draw once, at the noise of the step that releases it.

Opacus's accountant counts optimizer steps (its hook on the DP optimizer), at the noise
multiplier in force at the step: a draw consumed without a step was never counted, and with a
sampler that advanced by steps it could be drawn again. Under the shared sampler
(:mod:`.poisson`) each draw is handed out once and counted once:

- at the optimizer step taken on it, with the noise multiplier of that step (a noise scheduler
  stepped between the draw and the step, or worker processes that fetched the draw ahead, change
  nothing: the step's noise is what released it);
- without a step, when the loop moves on to a later draw, with the smallest multiplier in force
  since it was handed out (a skipped step costs the privacy of a step taken);
- a second step on the same draw counts once more, with a warning.

A draw handed out and never given to the loop (fetched ahead by workers when the run ended) is
never released and not counted. A step's summed gradient must come from one draw: accumulating
several draws into one noised step (``signal_skip_step`` across loader batches) releases their
sum with the noise of one, which the accountant cannot count, and is refused.
"""

from __future__ import annotations

import logging

from .._opacus_internals import last_step_skipped
from .poisson import SharedPoissonSampler

logger = logging.getLogger("opacus_fsdp_sync")

SECOND_STEP_WARNING = (
    "[Ghost] a second optimizer step on the same Poisson draw: its examples are released twice, "
    "so the accountant counts one more step. Draw a new batch (next(iter(loader))) for every "
    "step."
)


class DrawsAccumulatedError(RuntimeError):
    """An optimizer step would release the sum of several Poisson draws' gradients."""


class DrawAccount:
    """Counts each draw of ``sampler`` with ``accountant`` (see the module's rules).

    Args:
        accountant: Opacus's accountant.
        optimizer: The DP optimizer (its ``noise_multiplier`` is read at each event).
        sampler: The shared sampler.
    """

    def __init__(self, accountant, optimizer, sampler: SharedPoissonSampler):
        self.accountant, self.optimizer, self.sampler = accountant, optimizer, sampler
        #: Draws handed out and not yet counted: index -> smallest multiplier seen since.
        self.pending: dict[int, float] = {}
        #: The draw whose gradient the optimizer's summed gradient holds (None: none held).
        self.accumulating: int | None = None

    def reset(self) -> None:
        """Forgets pending draws and the held sum's draw (a checkpoint was loaded)."""
        self.pending.clear()
        self.accumulating = None

    def _count(self, noise_multiplier: float) -> None:
        self.accountant.step(
            noise_multiplier=noise_multiplier, sample_rate=self.sampler.sample_rate
        )

    def _settle_before(self, current: int, noise_multiplier: float) -> None:
        """Counts every pending draw before ``current`` (the loop moved past it, no step)."""
        for index in sorted(self.pending):
            sigma = min(self.pending[index], noise_multiplier)
            if index < current:
                del self.pending[index]
                self._count(sigma)
            else:
                self.pending[index] = sigma

    def on_draw(self, _count: int) -> None:
        """A draw handed out: pending until its step, or until the loop moves past it."""
        sigma = self.optimizer.noise_multiplier
        self.pending[self.sampler.handed_out - 1] = sigma
        self._settle_before(self.sampler.current, sigma)

    def on_accumulate(self) -> None:
        """Before the optimizer adds the loop's gradient to its sum: one draw per sum.

        Raises:
            DrawsAccumulatedError: when the sum holds another draw's gradient (the last step
                was skipped on that draw); nothing is changed.
        """
        current = self.sampler.current
        held = self.accumulating if last_step_skipped(self.optimizer) else None
        if held is not None and held != current:
            raise DrawsAccumulatedError(
                f"[Ghost] this optimizer step would add Poisson draw {current}'s gradient to the "
                f"sum kept from draw {held} (a step skipped with signal_skip_step on another "
                "draw): one noised step releasing several draws is not what the accountant "
                "counts. Take one optimizer step per draw: for larger batches raise the "
                "DataLoader's batch_size (the expected batch) and bound memory with "
                "BatchMemoryManager, which splits each draw. After a physical batch that failed "
                "outside the backward (in the forward or the loss), call "
                "opacus_fsdp_sync.abandon_step(optimizer) before going on (a failed backward "
                "does it itself)."
            )
        self.accumulating = current

    def on_step(self, opt) -> bool:
        """An optimizer step taken: counts its release at the step's multiplier.

        The draw it released leaves :attr:`pending` (a second step on a draw counts again).

        Returns:
            Whether the step was the first on its draw.
        """
        sigma = opt.noise_multiplier
        current = self.sampler.current
        self._settle_before(current, sigma)
        first = self.sampler.step_taken()
        self.pending.pop(current, None)
        self._count(sigma)
        self.accumulating = None
        return first


def account_draws(accountant, optimizer, sampler: SharedPoissonSampler, on_step) -> DrawAccount:
    """The accountant counts every draw ``sampler`` hands out (:class:`DrawAccount`'s rules).

    ``on_step`` is called on every step taken. The optimizer's ``accumulate`` (a
    fast-gradient-clipping optimizer's, which every ghost mode has: ``pre_step`` calls it on
    every step, skipped or not) first checks that its sum keeps to one draw.
    """
    account = DrawAccount(accountant, optimizer, sampler)
    inner = optimizer.accumulate

    def accumulate(*args, **kwargs):
        account.on_accumulate()
        return inner(*args, **kwargs)

    def step_hook(opt) -> None:
        on_step()
        if not account.on_step(opt):
            logger.warning(SECOND_STEP_WARNING)

    sampler.on_draw = account.on_draw
    optimizer.step_hook = step_hook
    optimizer.accumulate = accumulate
    return account


def count_steps(optimizer, on_step) -> None:
    """Calls ``on_step`` after the step hook Opacus attached (its accountant's)."""
    account = optimizer.step_hook

    def step_hook(opt) -> None:
        if account is not None:
            account(opt)
        on_step()

    optimizer.step_hook = step_hook


def track_progress(optimizer, sampler: SharedPoissonSampler | None, record) -> None:
    """Calls ``record`` after every optimizer step and every draw ``sampler`` hands out.

    Chained after the hooks already attached (the accountant's), so that ``record`` sees the
    count that includes this draw or step (the engine's draw ledger, :mod:`.ledger`).
    """
    step_hook = optimizer.step_hook

    def on_step(opt) -> None:
        if step_hook is not None:
            step_hook(opt)
        record()

    optimizer.step_hook = on_step
    if sampler is not None:
        counted = sampler.on_draw

        def on_draw(count: int) -> None:
            if counted is not None:
                counted(count)
            record()

        sampler.on_draw = on_draw
