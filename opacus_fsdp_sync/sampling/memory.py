"""Physical batches under the shared Poisson draw: the same count on every rank.

Opacus's ``BatchMemoryManager`` splits each rank's own logical batch into
``ceil(local size / max)`` physical batches, so ranks with different local sizes run different
numbers of forward/backward passes and a collective waits forever. Under
:class:`~.poisson.SharedPoissonSampler` every rank knows the global count, hence the largest
share, hence one count for all ranks (no collective); a rank whose share runs out first takes
part with fewer examples, or with an empty batch when its share is smaller than the count
(a zero contribution, see :mod:`..empty_batch`).

``BatchMemoryManager`` is used unchanged: importing this package routes Opacus's
``wrap_data_loader`` here for loaders over the shared sampler and leaves every other loader to
Opacus.
"""

from __future__ import annotations

import math
from collections import deque

import opacus.utils.batch_memory_manager as bmm
from torch.utils.data import DataLoader, Sampler

from .delivery import count_delivered
from .poisson import SharedPoissonSampler, physical_batches, worker_settings

_opacus_wrap_data_loader = bmm.wrap_data_loader


class EqualCountSplittingSampler(Sampler[list[int]]):
    """Splits each logical step's local share into the count every rank agrees on.

    Args:
        sampler: The shared Poisson sampler.
        max_batch_size: Largest physical batch.
        optimizer: The DP optimizer, told which physical batch ends the logical step.
    """

    def __init__(self, *, sampler: SharedPoissonSampler, max_batch_size: int, optimizer):
        if max_batch_size <= 0:
            raise ValueError(f"max_physical_batch_size must be positive, got {max_batch_size}")
        self.sampler, self.max_batch_size, self.optimizer = sampler, max_batch_size, optimizer
        #: Whether each physical batch handed out and not yet given to the loop ends its draw
        #: (read by :class:`SplitDrawLoader` where worker processes fetch ahead).
        self.ends: deque[bool] = deque()

    def __iter__(self):
        world, m = self.sampler.world_size, self.max_batch_size
        self.ends.clear()  # a new loader iterator: an abandoned one's batches are never given
        for local, total in self.sampler.draws():
            n = physical_batches(total, world, m)
            for i, chunk in enumerate(near_equal_chunks(local, n)):
                self.optimizer.signal_skip_step(do_skip=i < n - 1)
                self.ends.append(i == n - 1)
                yield chunk

    def __len__(self) -> int:
        expected = self.sampler.sample_rate * self.sampler.num_samples / self.sampler.world_size
        return len(self.sampler) * max(1, math.ceil(expected / self.max_batch_size))


class SplitDrawLoader(DataLoader):
    """The loader of :class:`EqualCountSplittingSampler`'s physical batches.

    With worker processes it counts each draw as delivered when the draw's last physical batch
    reaches the loop (:mod:`.delivery`).
    """

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        split = self.batch_sampler
        return count_delivered(super().__iter__, split.sampler, split.ends.popleft)


def near_equal_chunks(items: list[int], n: int) -> list[list[int]]:
    """``items`` in ``n`` consecutive chunks whose sizes differ by at most one (larger first).

    A share one example short of the largest then still fills every physical batch; a chunk is
    empty only when the share is smaller than the count.
    """
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        out.append(items[start : start + size])
        start += size
    return out


def wrap_data_loader(*, data_loader: DataLoader, max_batch_size: int, optimizer) -> DataLoader:
    """Opacus's ``wrap_data_loader``, with equal physical-batch counts for the shared sampler."""
    sampler = data_loader.batch_sampler
    if not isinstance(sampler, SharedPoissonSampler):
        return _opacus_wrap_data_loader(
            data_loader=data_loader, max_batch_size=max_batch_size, optimizer=optimizer
        )
    return SplitDrawLoader(
        dataset=data_loader.dataset,
        batch_sampler=EqualCountSplittingSampler(
            sampler=sampler, max_batch_size=max_batch_size, optimizer=optimizer
        ),
        collate_fn=data_loader.collate_fn,
        **worker_settings(data_loader),
    )


def install() -> None:
    """Routes Opacus's ``BatchMemoryManager`` through :func:`wrap_data_loader` (idempotent)."""
    bmm.wrap_data_loader = wrap_data_loader
