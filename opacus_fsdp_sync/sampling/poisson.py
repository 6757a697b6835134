"""Poisson sampling shared by every rank: one global draw per logical step, split evenly.

Opacus's distributed sampler draws each rank's examples independently and skips empty draws, so
ranks can run different numbers of steps and a collective waits forever. Here every rank draws
the *same* global Poisson sample (each example joins with probability ``q``, independently),
from a seed that rank 0 broadcasts once, and takes an even share of it (local sizes differ by at
most one). The global batch is exactly a single-process Poisson sample, so the single-process
accounting holds; an empty draw is still a step.

Step ``t``'s draw depends only on the seed and ``t``: numpy's PCG64 keyed by both through a
``SeedSequence``, which keeps every bit of each. (A ``torch.Generator`` on CPU keeps only the low
32 bits of its seed: seeded per step, two steps of one run would draw the same batch with
probability about ``T^2 / 2^33`` over ``T`` steps, a quarter at 50,000.) The sampler
advances by draws *handed out*, never by optimizer steps: each draw is used at most once, whether
or not a step followed it (a step skipped after an out-of-memory error, a batch consumed by hand).
Its state is the seed and the number of draws handed out, so a checkpoint restores it exactly.
Each draw handed out is reported to :attr:`SharedPoissonSampler.on_draw`; the engine's
accountant (:mod:`.accounting`) counts it at the step that releases it, or when the loop moves
past it without a step (a skipped step costs the privacy of a step taken).

The seed comes from :mod:`..randomness` (OS entropy, or the engine's explicit ``dp_seed``); it
is secret: whoever knows it knows every draw.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sized

import numpy as np
import torch
import torch.distributed as dist
from opacus.data_loader import dtype_safe, shape_safe, wrap_collate_with_empty
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from ..randomness import broadcast_seed, os_seed
from .delivery import count_delivered

logger = logging.getLogger(__name__)


def shared_seed(*, secure: bool = True, device: torch.device | None = None) -> int:
    """A seed from OS entropy on rank 0, broadcast to every rank (never logged).

    Collective: every rank must call it.

    Args:
        secure: Kept for callers of earlier releases; every seed comes from the OS CSPRNG.
        device: Where the broadcast tensor lives (NCCL needs a CUDA tensor).
    """
    del secure
    return broadcast_seed(os_seed(), device)


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of draw ``step``: PCG64 keyed by every bit of ``seed`` and of ``step``.

    Distinct ``(seed, step)`` pairs give independent streams (``SeedSequence`` hashes both into
    PCG64's 128-bit state), unlike a CPU ``torch.Generator``, whose Mersenne Twister keeps only
    a seed's low 32 bits.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(step,))))


class SharedPoissonSampler(Sampler[list[int]]):
    """Yields this rank's share of one global Poisson sample per logical step.

    Args:
        num_samples: Size of the dataset (N).
        sample_rate: Probability ``q`` with which each example joins each logical batch.
        steps: Logical steps per epoch (Opacus: the original loader's length).
        seed: The same on every rank (see :func:`shared_seed`).
        rank: This rank's index.
        world_size: Number of ranks sharing the draw.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        steps: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples, self.sample_rate, self.steps = num_samples, sample_rate, steps
        self.seed, self.rank, self.world_size = seed, rank, world_size
        #: Draws handed out so far: the next draw's index. Never goes back.
        self.handed_out = 0
        #: ``handed_out`` at the last optimizer step (see :meth:`step_taken`).
        self._stepped_at = 0
        #: Draws whose last batch a loader with worker processes has given to the training
        #: loop (:mod:`.delivery`); None: no such loader, every draw handed out is in use.
        self.delivered: int | None = None
        #: With such a loader, the index of the draw whose batch the loop was given last (None:
        #: none yet).
        self.in_loop: int | None = None
        #: Called with the global count of each draw as it is handed out (the engine's
        #: accountant); None: nobody counts.
        self.on_draw: Callable[[int], None] | None = None

    @property
    def completed(self) -> int:
        """Draws handed out (earlier name of :attr:`handed_out`)."""
        return self.handed_out

    @completed.setter
    def completed(self, value: int) -> None:
        self.handed_out = self._stepped_at = int(value)
        self.delivered = self.in_loop = None

    @property
    def current(self) -> int:
        """The index of the draw the training loop is on (-1 before the first).

        The last draw handed out, or, behind a loader whose workers fetch ahead, the draw of the
        last batch given to the loop (:attr:`in_loop`).
        """
        if self.delivered is None:
            return self.handed_out - 1
        return self.in_loop if self.in_loop is not None else self.delivered - 1

    def __len__(self) -> int:
        return self.steps

    def global_draw(self, step: int) -> torch.Tensor:
        """The indices of the global Poisson sample of logical step ``step`` (0-based, global).

        Each example joins independently with probability ``q``: the selected positions of a
        Bernoulli process, drawn as its independent geometric gaps (``P(gap = k) = (1 - q)^(k-1)
        q``), so a step costs O(N q) rather than a draw per example. Sorted ascending. The
        uniforms come from :func:`step_rng` (the whole seed and ``step``).
        """
        n, q = self.num_samples, self.sample_rate
        if q >= 1.0:
            return torch.arange(n)
        rng = step_rng(self.seed, step)
        expected = n * q
        chunk = int(expected + 6 * math.sqrt(expected) + 16)
        log_keep = math.log1p(-q)
        parts, last = [], -1.0
        while True:
            u = torch.from_numpy(rng.random(chunk))  # float64 in [0, 1)
            gaps = torch.floor(torch.log1p(-u) / log_keep) + 1  # log1p(-u) = log of U(0, 1]
            positions = last + torch.cumsum(gaps, 0)
            inside = positions[positions < n]
            parts.append(inside)
            if inside.numel() < chunk:
                return torch.cat(parts).long()
            last = float(positions[-1])

    def local_share(self, selected: torch.Tensor) -> list[int]:
        """This rank's even share of a global selection (sizes differ by at most one)."""
        return selected.tensor_split(self.world_size)[self.rank].tolist()

    def draws(self) -> Iterator[tuple[list[int], int]]:
        """``(local indices, global count)`` for the rest of the current epoch.

        Each draw is taken as it is handed out: the next one is always the first never handed
        out, whichever iterator asks (an abandoned or concurrent iterator never repeats a draw).
        """
        end = (self.handed_out // self.steps + 1) * self.steps
        while self.handed_out < end:
            step = self.handed_out
            self.handed_out += 1
            selected = self.global_draw(step)
            count = int(selected.numel())
            if self.on_draw is not None:
                self.on_draw(count)
            yield self.local_share(selected), count

    def __iter__(self) -> Iterator[list[int]]:
        for local, _ in self.draws():
            yield local

    def step_taken(self) -> bool:
        """Records an optimizer step; False when a step was already taken on the current draw.

        A second step without a new draw releases the same examples twice: the engine counts
        it as one more step and warns. A new draw is one handed out, or, behind a loader whose
        workers fetch ahead, one given to the training loop (:attr:`delivered`).
        """
        used = self.handed_out if self.delivered is None else self.delivered
        fresh = self._stepped_at != used
        self._stepped_at = used
        return fresh

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.handed_out // self.steps

    def state_dict(self) -> dict:
        """What restores this sampler exactly (the seed is secret: keep checkpoints private)."""
        return {
            "seed": self.seed,
            "handed_out": self.handed_out,
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`'s output; the world size may differ (the draw is global).

        Raises:
            ValueError: if the checkpoint was taken with another dataset size, sample rate or
                epoch length.
        """
        for key, ours in (
            ("num_samples", self.num_samples),
            ("sample_rate", self.sample_rate),
            ("steps", self.steps),
        ):
            if state[key] != ours:
                raise ValueError(
                    f"The checkpoint's sampler has {key}={state[key]}, this run "
                    f"{ours}: it was taken with another dataset or batch size. "
                    "Resume with the same data loader (dataset and batch_size) as the run that "
                    "saved it."
                )
        self.seed = int(state["seed"])
        self.completed = int(state["handed_out"])


class SharedPoissonDataLoader(DataLoader):
    """A data loader over :class:`SharedPoissonSampler` that collates empty batches.

    Built by :meth:`from_data_loader` from the user's loader, as Opacus's ``DPDataLoader`` is;
    ``len()`` is the number of logical steps per epoch, so ``1 / len`` is the sample rate.
    """

    def __init__(self, dataset, *, sampler: SharedPoissonSampler, collate_fn, **kwargs):
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn, **kwargs)
        self.sample_rate = sampler.sample_rate
        self.distributed = sampler.world_size > 1

    def __iter__(self):
        """The loader's batches; with worker processes, counting each as delivered."""
        if self.num_workers == 0:  # nothing fetched ahead: handed out is in use
            return super().__iter__()
        return count_delivered(super().__iter__, self.batch_sampler, lambda: True)

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        seed: int | None = None,
        secure: bool = True,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> SharedPoissonDataLoader:
        """The shared-draw loader for ``data_loader``'s dataset and expected batch size.

        Collective: every rank must call it (rank 0's seed is broadcast).

        Args:
            data_loader: The user's loader (its dataset, length and worker settings).
            seed: The sampler's seed, the same on every rank (the engine's, from
                :mod:`..randomness`); None draws one from OS entropy on rank 0.
            secure: Kept for callers of earlier releases (seeds always come from OS entropy).
            batch_first: As in Opacus.
            rand_on_empty: As in Opacus.
            rank: This rank among those sharing the draw (None: the process group's).
            world_size: How many ranks share the draw (None: the process group's size; 1 for a
                one-device model inside a process group).

        Raises:
            ValueError: for an iterable dataset, one without ``len``, or an empty one.
        """
        del secure
        dataset = data_loader.dataset
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            raise ValueError(
                "Poisson sampling needs a map-style dataset with len() and integer indexing; "
                f"got {type(dataset).__name__}. Use a map-style Dataset, or pass "
                "poisson_sampling=False (the reported epsilon then does not hold)."
            )
        n = len(dataset)
        steps = len(data_loader)
        if n == 0 or steps == 0:
            raise ValueError("Poisson sampling over an empty dataset or loader")
        try:
            first = dataset[0]
        except Exception as err:  # noqa: BLE001 - re-raised with what to do
            raise ValueError(
                f"Poisson sampling indexes the dataset by integers; {type(dataset).__name__}[0] "
                f"raised {type(err).__name__}: {err}"
            ) from err
        grouped = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if grouped else 0
        world = world_size if world_size is not None else dist.get_world_size() if grouped else 1
        sampler = SharedPoissonSampler(
            num_samples=n,
            sample_rate=1 / steps,
            steps=steps,
            seed=shared_seed() if seed is None else seed,
            rank=rank,
            world_size=world,
        )
        items = first if isinstance(first, (tuple, list)) else (first,)
        collate = wrap_collate_with_empty(
            collate_fn=data_loader.collate_fn or default_collate,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
            sample_empty_shapes=[(0, *shape_safe(x)) for x in items],
            dtypes=[dtype_safe(x) for x in items],
        )
        if data_loader.drop_last:
            logger.warning("Ignoring drop_last: Poisson batches have no fixed size")
        logger.info(
            "[Ghost] sampling: shared Poisson draw over %d examples, q = %.6g, %d steps per "
            "epoch, split evenly across %d rank(s)",
            n,
            sampler.sample_rate,
            steps,
            world,
        )
        return cls(dataset, sampler=sampler, collate_fn=collate, **worker_settings(data_loader))


def worker_settings(data_loader: DataLoader) -> dict:
    """The loader's settings that a loader rebuilt over another batch sampler keeps."""
    return {
        name: getattr(data_loader, name)
        for name in (
            "num_workers",
            "pin_memory",
            "timeout",
            "worker_init_fn",
            "multiprocessing_context",
            "prefetch_factor",
            "persistent_workers",
        )
    }


def physical_batches(global_count: int, world_size: int, max_batch_size: int) -> int:
    """Physical batches per rank for one logical step: the same on every rank, no collective."""
    largest_share = math.ceil(global_count / world_size)
    return max(1, math.ceil(largest_share / max_batch_size))
