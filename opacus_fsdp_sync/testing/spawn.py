"""Run a function on several CPU/gloo ranks in fresh processes and collect their results.

Each rank writes its result (or its traceback) to a file, flushes, and leaves with ``os._exit``:
with torch 2.13 on CPU the normal interpreter teardown after FSDP use can abort. The parent
judges from the files only, and kills every rank that outlives the timeout.

Ranks are forked from a fork server that has imported torch, opacus and this package once
(:data:`PRELOAD`) and has run nothing: no thread pool, no process group. A rank then starts in
well under a second instead of the 3.5 that importing them costs each fresh interpreter. Each
rank takes the caller's environment as it is at the call (a fork server's children would
otherwise see the server's, fixed when it started), once its function and arguments are
unpickled: what the preloaded modules, and any module imported while unpickling, read from the
environment at import time is the server's. Forked ranks also share the server's string-hash
seed, where ranks that ``torchrun`` starts each draw their own: a rank-dependent iteration
order of a set of strings would go unseen here. ``OFS_RANKS_START=spawn`` starts every rank as
a fresh interpreter instead, as ``torchrun`` does (and as a platform without ``fork`` does);
the suites launched through ``torchrun`` (the profiling suite, the trainer) always do.
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

#: Modules the fork server imports before it forks any rank (the slow imports every test shares).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "opacus",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "opacus_fsdp_sync",
]
#: The environment variable that picks the start method (``forkserver``, the default, or
#: ``spawn``).
START_ENV = "OFS_RANKS_START"

_context = None


def _rank_context():
    """The multiprocessing context ranks start from (see the module docstring); made once."""
    global _context
    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV}={method!r}: choose 'forkserver' or 'spawn'")
    if method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        method = "spawn"
    if _context is None or _context.get_start_method() != method:
        _context = mp.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload(PRELOAD)
    return _context


class RankFailure(RuntimeError):
    """A spawned rank raised, died, or timed out."""


def _rank_main(
    fn: Callable, rank: int, world: int, port: int, outdir: str, args: tuple, env: dict
) -> None:
    out = Path(outdir) / f"rank{rank}.pkl"
    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
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
    ctx = _rank_context()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ofs_ranks_") as outdir:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, port, outdir, args, env))
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
