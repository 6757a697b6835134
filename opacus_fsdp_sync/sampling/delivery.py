"""Draws that reached the training loop, where a loader's worker processes fetch ahead.

A data loader with ``num_workers > 0`` asks its batch sampler for the next batches before the
training loop takes them (``num_workers x prefetch_factor`` ahead), so the shared sampler's
:attr:`~.poisson.SharedPoissonSampler.handed_out` runs ahead of the draws the loop has used.
The check for a second optimizer step on one draw
(:meth:`~.poisson.SharedPoissonSampler.step_taken`) once compared against ``handed_out``: in the
last steps of an epoch, when nothing is left to fetch, every step looked like a second one on
its draw, each was counted once more and warned about. Here the loader counts the draws whose
last batch it has given to the loop (:attr:`~.poisson.SharedPoissonSampler.delivered`) and
the draw of the batch it gave last (:attr:`~.poisson.SharedPoissonSampler.in_loop`): the check
reads the first, and the accountant (:mod:`.accounting`) counts a draw at the step on
:attr:`~.poisson.SharedPoissonSampler.current`, never at its hand-out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: poisson.py imports this module
    from .poisson import SharedPoissonSampler


def count_delivered(
    batches: Callable[[], Iterator], sampler: SharedPoissonSampler, ends_draw: Callable[[], bool]
) -> Iterator:
    """Yields the batches of ``batches()`` and counts, before each, whether it ends a draw.

    Args:
        batches: Makes the loader's own iterator (which starts fetching ahead at once).
        sampler: The shared sampler whose :attr:`~.poisson.SharedPoissonSampler.delivered`
            count follows the loop.
        ends_draw: Whether the next batch given to the loop is its draw's last (called once
            per batch, in order).
    """
    # every draw handed out before this iterator counts as delivered: an abandoned iterator's
    # fetched draws are never used (the accountant counts them once the loop moves past them)
    sampler.delivered = sampler.handed_out
    for batch in batches():
        ends = ends_draw()
        if sampler.delivered is None:  # a checkpoint loaded meanwhile: every draw handed out
            sampler.delivered = sampler.handed_out  # since then, this batch's included
            sampler.in_loop = sampler.delivered - 1
        else:
            sampler.in_loop = sampler.delivered  # the batch's draw: the first not yet ended
            if ends:
                sampler.delivered += 1
        yield batch
