"""Binding each CPU rank to its own share of the cores, as MPI launchers and ``run_cpu`` do.

Ranks on CPU that share every core of a machine also share them with each other's helper
threads: gloo's transport threads and, in a private step, the thread that draws the noise
(:mod:`opacus_fsdp_sync.optimizers.noise_prefetch`). The scheduler then runs one rank's helper
beside another rank's main thread, and every rank waits for the slowest at the next collective.
On a GPU each rank has a device of its own and its noise is drawn there; bound to its own cores,
a CPU rank is the same kind of unit: its helpers run in its own waits. MPI launchers and
``torch.backends.xeon.run_cpu`` bind ranks this way (one block of cores per rank; torchrun does
not); :func:`bind_rank_to_cores` does it for a process about to join a gloo process group, so
that the threads gloo starts inherit the binding.

Blocks are whole physical cores: a core's hyperthread siblings (from Linux's
``/sys/devices/system/cpu/cpu*/topology/thread_siblings_list``, :func:`read_siblings`) go to the
same rank, whether their ids are adjacent (``2i`` and ``2i + 1``) or far apart (``i`` and
``i + N``, as on most x86 servers, where blocks of adjacent ids would give two ranks the two
threads of the same cores). With fewer physical cores than ranks, or without the topology, the
blocks are of logical CPUs. What binding changed on one machine:
``memory_test/fsdp_llama3_profiling/results/cpu-2cores-small-bound-cores/``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

#: Where Linux describes each logical CPU (``cpu<i>/topology/thread_siblings_list``).
SYSFS_CPUS = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> set[int]:
    """The ids of a Linux CPU list (``"0-3,8,10-11"``).

    Args:
        text: The list as Linux writes it (a trailing newline allowed).

    Returns:
        The ids it names.

    Raises:
        ValueError: for text that is not a CPU list.
    """
    ids: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        ids.update(range(int(low), int(high or low) + 1))
    return ids


def read_siblings(cores: list[int], root: Path = SYSFS_CPUS) -> dict[int, frozenset[int]] | None:
    """Each core's hyperthread siblings, itself included, from Linux's topology files.

    Args:
        cores: The logical CPUs to look up.
        root: The folder holding ``cpu<i>/`` (Linux's; another in tests).

    Returns:
        ``{core: its siblings}``, or None where a core's file is missing or unreadable (not
        Linux, or a container that hides it): then ranks get blocks of logical CPUs.
    """
    siblings = {}
    for core in cores:
        try:
            text = (root / f"cpu{core}" / "topology" / "thread_siblings_list").read_text()
            siblings[core] = frozenset(parse_cpu_list(text) | {core})
        except (OSError, ValueError) as err:
            logger.debug("no topology for cpu %d: %s", core, err)
            return None
    return siblings


def physical_cores(cores: list[int], siblings: dict[int, frozenset[int]]) -> list[list[int]]:
    """``cores`` grouped by physical core, each group sorted, groups by their lowest id.

    Args:
        cores: The logical CPUs to group.
        siblings: Each core's hyperthread siblings (:func:`read_siblings`).

    Returns:
        One group per physical core, holding only the siblings in ``cores`` (a cpuset may
        leave some out).
    """
    allowed, seen, groups = set(cores), set(), []
    for core in sorted(allowed):
        if core not in seen:
            group = sorted((siblings.get(core, frozenset()) & allowed) | {core})
            seen.update(group)
            groups.append(group)
    return groups


def rank_cores(
    cores: list[int],
    local_rank: int,
    local_world: int,
    siblings: dict[int, frozenset[int]] | None = None,
) -> list[int]:
    """The block of ``cores`` that local rank ``local_rank`` of ``local_world`` gets.

    The cores are cut into physical cores (``siblings``), in order of their lowest id. Each
    rank gets ``len(units) // local_world`` consecutive units; the first
    ``len(units) % local_world`` ranks get one more, so every core is used once. Each logical
    CPU is its own unit without ``siblings``, with fewer physical cores than ranks, or where
    whole physical cores would give two ranks logical CPU counts more than one apart (three
    two-thread cores for two ranks: four and two; ranks wait for the slowest at every
    collective).

    Args:
        cores: The cores the processes may run on (sorted or not; sorted here).
        local_rank: This process's rank on the machine, ``0 <= local_rank < local_world``.
        local_world: Ranks on the machine.
        siblings: Each core's hyperthread siblings (:func:`read_siblings`); None: unknown.

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
    units = physical_cores(pool, siblings) if siblings else []
    blocks = _blocks(units, local_world) if len(units) >= local_world else []
    sizes = [sum(len(u) for u in b) for b in blocks]
    if not blocks or max(sizes) - min(sizes) > 1:
        blocks = _blocks([[c] for c in pool], local_world)
    return sorted(c for unit in blocks[local_rank] for c in unit)


def holds_whole_cores(
    block: list[int], cores: list[int], siblings: dict[int, frozenset[int]] | None
) -> bool | None:
    """Whether ``block`` holds every sibling in ``cores`` of each of its cores.

    Args:
        block: One rank's cores (:func:`rank_cores`).
        cores: The cores the processes may run on.
        siblings: Each core's hyperthread siblings (:func:`read_siblings`); None: unknown.

    Returns:
        True where the rank has whole physical cores, False where it shares one with another
        rank, None where the topology is unknown.
    """
    if not siblings:
        return None
    allowed, mine = set(cores), set(block)
    return all(siblings[c] & allowed <= mine for c in block)


def _blocks(units: list[list[int]], world: int) -> list[list[list[int]]]:
    """``units`` in ``world`` consecutive blocks, the first ``len % world`` one unit longer."""
    share, extra = divmod(len(units), world)
    out, start = [], 0
    for r in range(world):
        size = share + (1 if r < extra else 0)
        out.append(units[start : start + size])
        start += size
    return out


def bind_rank_to_cores(
    local_rank: int | None = None, local_world: int | None = None
) -> list[int] | None:
    """Binds the calling thread, and the threads it starts later, to its block of the cores.

    The blocks are of whole physical cores where Linux gives the topology (:func:`rank_cores`).

    Linux only. Call it before the process group starts: gloo's threads inherit the binding of
    the thread that starts them, and threads that already exist keep theirs. Without arguments
    the ranks are torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; where either is unset,
    nothing is bound (a guessed rank could put every rank on the same block).

    Args:
        local_rank: This process's rank on the machine.
        local_world: Ranks on the machine.

    Returns:
        The sorted cores bound, or None where nothing was bound (logged): no rank given or in
        the environment, no ``sched_setaffinity`` on this platform, fewer cores than ranks, or
        the binding refused by the system.

    Raises:
        ValueError: for a rank outside ``[0, local_world)``.
    """
    if local_rank is None or local_world is None:
        if "LOCAL_RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
            logger.info("[Ghost] ranks left unbound: LOCAL_RANK / LOCAL_WORLD_SIZE not set")
            return None
        local_rank = int(os.environ["LOCAL_RANK"]) if local_rank is None else local_rank
        local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if local_world is None else local_world
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
    siblings = read_siblings(cores)
    mine = rank_cores(cores, local_rank, local_world, siblings)
    try:
        os.sched_setaffinity(0, mine)
    except OSError as err:
        logger.info("[Ghost] ranks left unbound: the system refused the binding (%s)", err)
        return None
    logger.info(
        "[Ghost] local rank %d bound to cores %s (%s)",
        local_rank,
        mine,
        {
            True: "whole physical cores",
            False: "logical CPUs: whole cores would not split evenly, one is shared",
            None: "logical CPUs: the hyperthread topology is unknown",
        }[holds_whole_cores(mine, cores, siblings)],
    )
    return mine
