"""Run a function on several CPU/gloo ranks in fresh processes and collect their results.

Each rank writes its result (or its traceback) to a file, flushes, and leaves with ``os._exit``:
with torch 2.13 on CPU the normal interpreter teardown after FSDP use can abort. The parent
judges from the files only, and kills every rank that outlives the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ..distributed.env import free_port


class RankFailure(RuntimeError):
    """A spawned rank raised, died, or timed out."""


def _rank_main(fn: Callable, rank: int, world: int, port: int, outdir: str, args: tuple) -> None:
    out = Path(outdir) / f"rank{rank}.pkl"
    code = 0
    try:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            payload = ("ok", fn(rank, world, *args))
            # Rank 0 hosts the rendezvous store: nobody leaves before everybody is done.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        payload = ("error", traceback.format_exc())
        code = 1
    with open(out, "wb") as f:
        pickle.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os._exit(code)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 300.0) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: An importable (module-level) function; its return value must pickle.
        world_size: Number of ranks.
        *args: Extra picklable arguments for ``fn``.
        timeout: Seconds before every rank is killed and :class:`RankFailure` raised (a hung
            collective fails instead of hanging).

    Returns:
        The per-rank return values, by rank.

    Raises:
        RankFailure: with the rank's traceback when a rank raised, died or timed out.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ofs_ranks_") as outdir:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, port, outdir, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        errors = []
        for r in range(world_size):
            path = Path(outdir) / f"rank{r}.pkl"
            if not path.exists():
                why = "timed out" if r in hung else f"died (exit code {procs[r].exitcode})"
                errors.append(f"rank {r} {why} without a result")
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if errors:
            raise RankFailure("\n".join(errors))
        return results
