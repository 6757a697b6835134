"""Who counts a private step: the accountant counts each Poisson draw as it is handed out.

Opacus's accountant counts optimizer steps (its hook on the DP optimizer): a draw consumed
without a step was never counted, and with a sampler that advanced by steps it could be drawn
again. Under the shared sampler (:mod:`.poisson`) each draw is handed out once and counted then;
the engine's step counter follows the optimizer either way.
"""

from __future__ import annotations

import logging

from .poisson import SharedPoissonSampler

logger = logging.getLogger("opacus_fsdp_sync")


def account_draws(accountant, optimizer, sampler: SharedPoissonSampler, on_step) -> None:
    """The accountant counts every draw ``sampler`` hands out, when it hands it out.

    Opacus counts optimizer steps: a draw consumed without a step (skipped after an error, or
    accumulated by hand) was never counted. Here each draw counts once, step or not, and an
    optimizer step on a draw that already had one (the same examples released twice) counts
    once more, with a warning. ``on_step`` is called on every step taken.
    """
    q = sampler.sample_rate

    def on_draw(_count: int) -> None:
        accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=q)

    def step_hook(opt) -> None:
        on_step()
        if not sampler.step_taken():
            logger.warning(
                "[Ghost] a second optimizer step on the same Poisson draw: its examples are "
                "released twice, so the accountant counts one more step. Draw a new batch "
                "(next(iter(loader))) for every step."
            )
            accountant.step(noise_multiplier=opt.noise_multiplier, sample_rate=q)

    sampler.on_draw = on_draw
    optimizer.step_hook = step_hook


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
