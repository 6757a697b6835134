"""A Poisson draw as the physical batches ``BatchMemoryManager`` runs, for the profiling suite.

Under Poisson sampling a draw has no fixed size, and its largest draws may not fit a card whole.
Opacus's ``BatchMemoryManager`` then runs each draw as physical batches of at most
``max_physical_batch_size`` examples (under the shared sampler with the same count on every rank:
:mod:`opacus_fsdp_sync.sampling.memory`), the optimizer told to skip every step but the last.
The profiling suite (``--max-physical-batch-size``) runs its private and non-private rows on the
same split, so that both are timed on the same physical batches: this module is that split, how
a step's phases add up over its physical batches, and the draw's loss.
"""

from __future__ import annotations

from ..sampling.memory import near_equal_chunks
from ..sampling.poisson import physical_batches


def physical_slices(local: int, drawn: int, world: int, cap: int | None) -> list[slice]:
    """The physical batches of one draw, as ``BatchMemoryManager`` splits a shared draw.

    Args:
        local: This rank's share of the draw.
        drawn: The draw's size over every rank (unused when ``cap`` is None).
        world: Ranks.
        cap: ``max_physical_batch_size``; None: the share in one batch.

    Returns:
        Consecutive slices of the share, one per physical batch: the same count on every rank
        (:func:`~opacus_fsdp_sync.sampling.poisson.physical_batches`), sizes within one of each
        other (:func:`~opacus_fsdp_sync.sampling.memory.near_equal_chunks`), an empty slice
        where the share is smaller than the count.
    """
    if cap is None:
        return [slice(0, local)]
    out, start = [], 0
    for chunk in near_equal_chunks(list(range(local)), physical_batches(drawn, world, cap)):
        out.append(slice(start, start + len(chunk)))
        start += len(chunk)
    return out


def add_phases(into: dict[str, float], more: dict[str, float]) -> None:
    """Adds ``more``'s milliseconds into ``into``, phase by phase (a step's physical batches).

    Args:
        into: Milliseconds per phase, updated in place.
        more: One physical batch's milliseconds per phase.
    """
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


def draw_loss(chunk_losses: list[tuple], private: bool) -> float:
    """The draw's loss from its physical batches' ``(loss, share of the draw)``.

    ``no_dp``'s losses are already weighted by their shares (a stand-in's is zero); a private
    row's are each physical batch's mean, weighted here.

    Args:
        chunk_losses: Per physical batch, its loss (a tensor, or the engine's loss: anything
            ``float`` reads) and its share of this rank's draw.
        private: Whether the losses are a private row's.

    Returns:
        The draw's mean loss; for an empty share (every physical batch empty) the last
        physical batch's loss.
    """
    values = [(float(loss), w) for loss, w in chunk_losses]
    if not private:
        return sum(v for v, _ in values)
    if not any(w for _, w in values):
        return values[-1][0]
    return sum(v * w for v, w in values)
