"""The Trainer's training batches under the shared Poisson draw: one item per logical step.

The Trainer steps the optimizer once per item its training loader yields (with
``gradient_accumulation_steps=1``, which the integration sets). Each item here is one logical
step of the shared Poisson sampler: this rank's share of the global draw, already split into
the physical batches that every rank agrees on (:mod:`opacus_fsdp_sync.sampling.memory`'s rule:
``ceil(largest share / max physical batch)`` batches of near-equal size, computed from the
global count without a collective). A rank whose share is smaller than that count gets empty
physical batches; it still runs them (zero-weighted, see :mod:`opacus_fsdp_sync.empty_batch`),
so every rank joins every collective.

Each draw is taken from the sampler when the Trainer asks for the item, and counted by the
engine's accountant then (see :mod:`opacus_fsdp_sync.sampling.accounting`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ...errors import UnsupportedConfigurationError
from ...sampling.memory import near_equal_chunks
from ...sampling.poisson import SharedPoissonSampler, physical_batches

#: Keys of a flattened (padding-free) batch: several records' boundaries inside one row.
_FLATTENED_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"})


@dataclass(frozen=True)
class LogicalBatch:
    """One logical step on this rank: its physical batches, collated."""

    physical: list[dict]
    """Collated physical batches (dicts of tensors), in order; some may hold zero examples."""
    global_count: int
    """Examples in the global draw over every rank."""

    def __iter__(self) -> Iterator[dict]:
        return iter(self.physical)

    def __len__(self) -> int:
        return len(self.physical)

    @property
    def local_count(self) -> int:
        """Examples on this rank."""
        return sum(batch_size(b) for b in self.physical)


def batch_size(batch: Mapping) -> int:
    """Rows of the first tensor of a collated batch (0 for an empty physical batch)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


class LogicalBatches:
    """Iterable of :class:`LogicalBatch`, one per draw of the shared Poisson sampler.

    ``len()`` is the sampler's steps per epoch (the Trainer's update steps per epoch).

    Args:
        sampler: The engine's shared Poisson sampler.
        dataset: The training dataset (map-style), indexed by the sampler.
        collate_fn: The Trainer's data collator (its column filtering already applied).
        max_physical_batch_size: Most examples per physical batch on one rank.
    """

    def __init__(
        self,
        *,
        sampler: SharedPoissonSampler,
        dataset,
        collate_fn: Callable[[list], dict],
        max_physical_batch_size: int,
    ):
        if max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size={max_physical_batch_size}: must be >= 1")
        self.sampler, self.dataset, self.collate_fn = sampler, dataset, collate_fn
        self.max_physical_batch_size = max_physical_batch_size
        self._empty: dict | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[LogicalBatch]:
        world = self.sampler.world_size
        for local, total in self.sampler.draws():
            n = physical_batches(total, world, self.max_physical_batch_size)
            chunks = near_equal_chunks(local, n)
            yield LogicalBatch([self._collate(chunk) for chunk in chunks], total)

    def _collate(self, indices: list[int]) -> dict:
        if not indices:
            return self._empty_batch()
        batch = dict(self.collate_fn([self.dataset[i] for i in indices]))
        flattened = sorted(_FLATTENED_KEYS & batch.keys())
        if batch_size(batch) != len(indices) or flattened:
            raise UnsupportedConfigurationError(
                f"the data collator made {batch_size(batch)} row(s) of {len(indices)} records"
                f"{' with ' + ', '.join(flattened) if flattened else ''}: a padding-free "
                "(flattening) collator packs a batch into one sequence, which per-example "
                "clipping would clip as one example. Use a padding collator: one row per record."
            )
        return batch

    def _empty_batch(self) -> dict:
        """A batch of zero examples with the keys, dtypes and trailing shapes of a real one.

        Collators (padding ones especially) cannot collate an empty list: collate one example
        and keep none of its rows.
        """
        if self._empty is None:
            one = dict(self.collate_fn([self.dataset[0]]))
            self._empty = {
                k: v[:0] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in one.items()
            }
        return dict(self._empty)
