"""Where every seed of DP randomness comes from: OS entropy, unless the user opts in to a seed.

The epsilon the accountant reports assumes that nobody can know which examples a step drew or
what noise it added. Every seed behind those (the shared Poisson sampler's, each noise
generator's) is therefore drawn here, from the operating system's CSPRNG (``secrets``): never
from torch's global generator, so ``torch.manual_seed`` (a user's public ``--seed``) decides model
initialisation and data order only.

Reproducibility is an explicit opt-in, ``PrivacyEngine(dp_seed=...)``: every DP seed is then
derived from that one integer and a purpose name, so two runs with the same ``dp_seed`` draw the
same batches and the same noise. The run's privacy then rests on ``dp_seed`` staying secret (it
is logged as a warning, never its value). Tests and benchmarks use it to compare runs.

A DataLoader passed with its own ``generator=`` keeps upstream's behaviour: that generator seeds
the Poisson draw (:meth:`DPRandomness.sampler_seed`), with a warning that which examples each
step drew is then as secret as the generator's state; under ``secure_mode`` it is not used, also
with a warning.

Seeds that every rank must share (the sampler's, a shared noise draw's) are drawn on rank 0 and
broadcast; the per-shard noise streams mix rank 0's seed with the shard's coordinate
(:mod:`.optimizers.fsdp2`). Every generator made here depends on all 63 bits of its seed: a CPU
one gets its whole state from it (:mod:`._generator_internals`), where ``manual_seed`` would
keep 32 bits.
"""

from __future__ import annotations

import hashlib
import logging
import secrets

import torch
import torch.distributed as dist

from ._generator_internals import seeded_generator

logger = logging.getLogger(__name__)

_MASK64 = 2**64 - 1
#: Seeds are non-negative and below 2**63 (what ``torch.Generator.manual_seed`` and an int64
#: broadcast both take).
SEED_BITS = 63

REPRODUCIBLE_WARNING = (
    "[Ghost] dp_seed is set: the Poisson draws and the noise of this run are reproducible from "
    "it, and its privacy rests on the seed staying secret. Never publish it, never reuse it for "
    "another run on the same data, and leave it unset (OS entropy) for a release."
)

LOADER_GENERATOR_WARNING = (
    "[Ghost] the DataLoader's generator= seeds the Poisson draw (as in Opacus): which examples "
    "each step drew is as secret as that generator's state. Never publish its seed, and pass no "
    "generator (OS entropy) for a release."
)
LOADER_GENERATOR_SECURE_WARNING = (
    "[Ghost] the DataLoader's generator= is not used under secure_mode: the Poisson draw comes "
    "from OS entropy."
)


def splitmix64(seed: int, counter: int) -> int:
    """SplitMix64 of ``(seed, counter)``: well-spread, distinct seeds for distinct counters.

    Returns a value in ``[0, 2**63)``.
    """
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & (2**SEED_BITS - 1)


def os_seed() -> int:
    """A fresh seed from the operating system's CSPRNG (independent of torch's generators)."""
    return secrets.randbits(SEED_BITS)


def _purpose_code(purpose: str, index: int) -> int:
    digest = hashlib.sha256(f"{purpose}#{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def comm_device(device: torch.device | None = None) -> torch.device:
    """Where a small tensor for a collective on the default group goes.

    The CPU wherever gloo serves the group (``gloo``, ``cpu:gloo,cuda:nccl``); under NCCL alone
    ``device`` if it is a CUDA device, else the current CUDA device (never a CPU tensor, which
    NCCL refuses: FSDP2's CPU offload keeps the shards there).
    """
    backend = dist.get_backend()
    if "nccl" in backend and "gloo" not in backend:
        if device is not None and device.type == "cuda":
            return device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_seed(seed: int, device: torch.device | None = None) -> int:
    """Rank 0's ``seed`` on every rank (a no-op without a process group of several ranks).

    Collective: every rank must call it.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return seed
    t = torch.tensor([seed], dtype=torch.int64, device=comm_device(device))
    dist.broadcast(t, src=0)
    return int(t.item())


class DPRandomness:
    """The one source of the engine's DP seeds.

    Args:
        dp_seed: None (the default): every seed from OS entropy. An integer: every seed derived
            from it and the purpose (reproducible; privacy then rests on it staying secret).
        warn: Whether a ``dp_seed`` logs the reproducibility warning (False only for a
            non-private consumer of the same draws, such as a benchmark's non-private baseline).

    Raises:
        ValueError: for a negative ``dp_seed`` or one that is not an integer.
    """

    def __init__(self, dp_seed: int | None = None, *, warn: bool = True):
        if dp_seed is not None and (
            isinstance(dp_seed, bool) or not isinstance(dp_seed, int) or dp_seed < 0
        ):
            raise ValueError(f"dp_seed must be None or a non-negative int, got {dp_seed!r}")
        self.dp_seed = dp_seed
        self._drawn: dict[str, int] = {}
        if dp_seed is not None and warn:
            logger.warning(REPRODUCIBLE_WARNING)

    @property
    def reproducible(self) -> bool:
        """Whether seeds follow ``dp_seed`` (True) or OS entropy (False)."""
        return self.dp_seed is not None

    def local_seed(self, purpose: str) -> int:
        """A seed for ``purpose`` on this process (OS entropy, or derived from ``dp_seed``).

        With ``dp_seed``, the n-th seed of a purpose is the same in every run and differs from
        every other purpose's and from the purpose's other seeds (a second ``make_private``).
        """
        index = self._drawn.get(purpose, 0)
        self._drawn[purpose] = index + 1
        if self.dp_seed is None:
            return os_seed()
        return splitmix64(self.dp_seed, _purpose_code(purpose, index))

    def shared_seed(
        self, purpose: str, *, distributed: bool, device: torch.device | None = None
    ) -> int:
        """Rank 0's :meth:`local_seed` on every rank of a distributed model, else this process's.

        Collective when ``distributed``: every rank must call it. A one-device model in a
        process group (a reference on rank 0) draws its own seed and issues no collective.
        """
        seed = self.local_seed(purpose)
        return broadcast_seed(seed, device) if distributed else seed

    def sampler_seed(self, data_loader, *, secure_mode: bool, distributed: bool) -> int:
        """The Poisson sampler's seed: from the loader's own ``generator=``, else ours.

        A loader built with ``generator=`` gives the seed (one draw from it; rank 0's on every
        rank), as upstream samples from that generator: logged as a warning. Otherwise, and
        under ``secure_mode``, :meth:`shared_seed` of ``"sampler"``. Collective when
        ``distributed``.
        """
        given = getattr(data_loader, "generator", None)
        if given is None:
            return self.shared_seed("sampler", distributed=distributed)
        if secure_mode:
            logger.warning(LOADER_GENERATOR_SECURE_WARNING)
            return self.shared_seed("sampler", distributed=distributed)
        logger.warning(LOADER_GENERATOR_WARNING)
        seed = int(torch.randint(0, 2**62, (1,), generator=given, device=given.device))
        return broadcast_seed(seed) if distributed else seed

    def sampler_generator(self, data_loader, *, secure_mode: bool, rank: int) -> torch.Generator:
        """This rank's generator for Opacus's Poisson loader: its own stream, never another's.

        Opacus's distributed sampler draws each rank's mask over its own records from the
        rank's generator, so every rank needs a stream of its own (:meth:`rank_generator`). A
        loader built with ``generator=`` seeds it, as upstream samples from that generator
        (logged as a warning; the same loader generator on every rank still gives each rank its
        own stream, mixed with ``rank``). Issues no collective.
        """
        given = getattr(data_loader, "generator", None)
        if given is None or secure_mode:
            if given is not None:
                logger.warning(LOADER_GENERATOR_SECURE_WARNING)
            return self.rank_generator("sampler", torch.device("cpu"), rank=rank)
        logger.warning(LOADER_GENERATOR_WARNING)
        seed = int(torch.randint(0, 2**62, (1,), generator=given, device=given.device))
        mixed = splitmix64(seed, _purpose_code("rank:sampler", rank))
        return seeded_generator(torch.device("cpu"), mixed)

    def generator(
        self, purpose: str, device: torch.device, *, distributed: bool
    ) -> torch.Generator:
        """A generator on ``device`` seeded with :meth:`shared_seed`."""
        seed = self.shared_seed(purpose, distributed=distributed, device=device)
        return seeded_generator(device, seed)

    def noise_generator(self, optimizer, given, *, secure_rng, distributed: bool):
        """The noise generator: ``secure_rng``, the user's ``noise_generator``, or ours.

        Ours is seeded from this source (OS entropy unless ``dp_seed``), the same on every rank,
        on the parameters' device; never torch's global generator.

        Args:
            optimizer: The user's optimizer (unwrapped): its first parameter's device.
            given: The ``noise_generator`` passed to ``make_private``, or None.
            secure_rng: The engine's CSPRNG under ``secure_mode``, else None.
            distributed: Whether the layout is distributed (the seed is then rank 0's).
        """
        if secure_rng is not None:
            return secure_rng
        if given is not None:
            logger.warning(
                "[Ghost] noise_generator was passed: the noise is reproducible from its state, "
                "and the run's privacy rests on that state staying secret."
            )
            return given
        device = torch.device("cpu")
        for group in optimizer.param_groups:
            for p in group["params"]:
                device = p.device
                break
            break
        return self.generator("noise", device, distributed=distributed)

    def rank_generator(self, purpose: str, device: torch.device, *, rank: int) -> torch.Generator:
        """A generator on ``device`` for this rank alone: independent of every other rank's.

        For draws that each rank makes by itself over its own records (Opacus's distributed
        Poisson sampler draws each rank's mask from its own generator): a stream shared by the
        ranks would include records at equal positions of their index lists together, which
        is not Poisson sampling. The seed is :meth:`local_seed` (OS entropy, or derived from
        ``dp_seed``) mixed with ``rank``, so with ``dp_seed`` every rank still draws a stream of
        its own. Issues no collective.
        """
        seed = splitmix64(self.local_seed(purpose), _purpose_code(f"rank:{purpose}", rank))
        return seeded_generator(device, seed)


_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct coordinates give distinct seeds


def shard_generator(generator, device: torch.device, coordinate: tuple[int, ...]):
    """A generator on ``device``: rank 0's seed (broadcast) mixed with the shard coordinate.

    Rank 0's seed is drawn from ``generator`` (the engine's, see :class:`DPRandomness`), or from
    OS entropy when it is None, never from torch's global generator. Collective.
    """
    return shard_generators(generator, device, [coordinate])[0]


def shard_generators(generator, device: torch.device, coordinates: list[tuple]):
    """:func:`shard_generator` for several coordinates of this rank, from one broadcast seed.

    Every rank must call it (once, whatever the number of coordinates). Equal coordinates give
    equal streams on every rank; different ones independent streams. A coordinate is a tuple of
    ints, or of such tuples (never strings: their hash differs between processes).
    """
    if generator is None:
        seed = os_seed()
    else:
        seed = int(
            torch.randint(
                0, 2**62, (1,), generator=generator, dtype=torch.int64, device=generator.device
            ).item()
        )
    base = broadcast_seed(seed, device)
    return [
        seeded_generator(device, (base ^ ((hash(tuple(c)) % 2**61 + 1) * _MIX)) % (2**63))
        for c in coordinates
    ]


def shared_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator on ``device`` whose state is rank 0's (``generator``'s, or an OS seed).

    Collective: every rank must call it (the state is broadcast).
    """
    shared = torch.Generator(device=device)
    if dist.get_rank() == 0:
        if generator is not None and generator.device == device:
            shared.set_state(generator.get_state())
        else:
            seed = (
                int(
                    torch.randint(
                        0, 2**62, (1,), generator=generator, device=generator.device
                    ).item()
                )
                if generator is not None
                else os_seed()  # never torch's global generator
            )
            shared.set_state(seeded_generator(device, seed).get_state())
    state = shared.get_state()
    buf = state.to(comm_device(device))
    dist.broadcast(buf, src=0)
    shared.set_state(buf.cpu())
    return shared
