"""Binding CPU ranks to their own cores (``distributed.cpu_affinity``).

The partition is checked as a function; the binding itself runs in a child process (started
with ``sys.executable``), so that the test runner keeps the cores it had.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opacus_fsdp_sync.distributed.cpu_affinity import bind_rank_to_cores, rank_cores


@pytest.mark.parametrize(
    ("cores", "world", "expected"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([7, 3, 5], 3, [[3], [5], [7]]),
        ([0, 1, 2, 3], 1, [[0, 1, 2, 3]]),
        (list(range(10)), 4, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),
    ],
)
def test_every_core_goes_to_exactly_one_rank(cores, world, expected):
    blocks = [rank_cores(cores, r, world) for r in range(world)]
    assert blocks == expected
    assert sorted(c for b in blocks for c in b) == sorted(cores)


def test_fewer_cores_than_ranks_is_refused_by_the_partition():
    with pytest.raises(ValueError, match="at least one core per rank"):
        rank_cores([0, 1], 0, 3)
    with pytest.raises(ValueError, match=r"must be in \[0, local_world\)"):
        rank_cores([0, 1], 2, 2)


def _child(local_rank: int, local_world: int) -> dict:
    code = (
        "import json, os\n"
        "from opacus_fsdp_sync.distributed.cpu_affinity import bind_rank_to_cores\n"
        f"bound = bind_rank_to_cores({local_rank}, {local_world})\n"
        "print(json.dumps({'bound': bound, 'now': sorted(os.sched_getaffinity(0))}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity only")
def test_a_rank_is_bound_to_its_block_and_stays_within_the_cores_it_had():
    cores = sorted(os.sched_getaffinity(0))
    world = min(2, len(cores))
    for r in range(world):
        got = _child(r, world)
        assert got["bound"] == rank_cores(cores, r, world)
        assert got["now"] == got["bound"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity only")
def test_more_ranks_than_cores_leaves_the_process_unbound():
    cores = sorted(os.sched_getaffinity(0))
    got = _child(0, len(cores) + 1)
    assert got["bound"] is None
    assert got["now"] == cores


def test_ranks_default_to_torchruns_environment(monkeypatch):
    """LOCAL_RANK / LOCAL_WORLD_SIZE are read when no rank is given (here: too many ranks)."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("Linux affinity only")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0)) + 1))
    assert bind_rank_to_cores() is None  # refused before touching this process's cores
