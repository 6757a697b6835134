"""Binding each CPU rank to its own share of the cores, as CPU launchers bind them.

Ranks on CPU that share every core of a machine also share them with each other's helper
threads: gloo's transport threads and, in a private step, the thread that draws the noise
(:mod:`opacus_fsdp_sync.optimizers.noise_prefetch`). The scheduler then runs one rank's helper
beside another rank's main thread, and every rank waits for the slowest at the next collective.
On a GPU each rank has a device of its own and its noise is drawn there; bound to its own cores,
a CPU rank is the same kind of unit: its helpers run in its own waits. CPU launchers bind ranks
this way (one block of cores per rank); :func:`bind_rank_to_cores` does it for a process about
to join a gloo process group, so that the threads gloo starts inherit the binding.

Measured on 2 cores with 2 ranks of the ``small`` preset at 64 tokens
(``memory_test/fsdp_llama3_profiling/results/cpu-2cores-small-bound-cores/``): the non-private
step is about as fast bound as unbound; the private step is shorter bound, its hand-off no
longer waiting for a rank whose core another rank's noise draw took.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def rank_cores(cores: list[int], local_rank: int, local_world: int) -> list[int]:
    """The contiguous block of ``cores`` that local rank ``local_rank`` of ``local_world`` gets.

    Each rank gets ``len(cores) // local_world`` cores; the first ``len(cores) % local_world``
    ranks get one more, so every core is used once.

    Args:
        cores: The cores the processes may run on (sorted or not; sorted here).
        local_rank: This process's rank on the machine, ``0 <= local_rank < local_world``.
        local_world: Ranks on the machine.

    Returns:
        The cores of this rank, sorted.

    Raises:
        ValueError: if there are fewer cores than ranks, or the rank is out of range.
    """
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(
            f"local_rank={local_rank} of local_world={local_world}: the rank must be in "
            "[0, local_world)"
        )
    pool = sorted(cores)
    if len(pool) < local_world:
        raise ValueError(
            f"{len(pool)} core(s) for {local_world} ranks: binding needs at least one core "
            "per rank (run fewer ranks, or leave the ranks unbound)"
        )
    share, extra = divmod(len(pool), local_world)
    start = local_rank * share + min(local_rank, extra)
    return pool[start : start + share + (1 if local_rank < extra else 0)]


def bind_rank_to_cores(local_rank: int | None = None, local_world: int | None = None):
    """Binds this process to its block of the cores it may use now (Linux); returns the block.

    Call it before the process group starts (gloo's threads inherit the binding of the thread
    that starts them). Ranks default to torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.

    Args:
        local_rank: This process's rank on the machine.
        local_world: Ranks on the machine.

    Returns:
        The sorted cores bound, or None where nothing was bound (no ``sched_setaffinity`` on
        this platform, or fewer cores than ranks: logged).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        logger.info("[Ghost] ranks left unbound: this platform has no sched_setaffinity")
        return None
    if len(cores) < local_world:
        logger.info(
            "[Ghost] ranks left unbound: %d core(s) for %d ranks on this machine",
            len(cores),
            local_world,
        )
        return None
    mine = rank_cores(cores, local_rank, local_world)
    os.sched_setaffinity(0, mine)
    return mine
