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

from opacus_fsdp_sync.distributed.cpu_affinity import rank_cores


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


def _child(local_rank: int | None, local_world: int | None, env: dict | None = None) -> dict:
    """Binds a child process (ranks as given; None: from its environment) and reports."""
    args = "" if local_rank is None else f"{local_rank}, {local_world}"
    code = (
        "import json, os\n"
        "from opacus_fsdp_sync.distributed.cpu_affinity import bind_rank_to_cores\n"
        f"bound = bind_rank_to_cores({args})\n"
        "print(json.dumps({'bound': bound, 'now': sorted(os.sched_getaffinity(0))}))\n"
    )
    child_env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    child_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=child_env,
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


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity only")
def test_ranks_come_from_torchruns_environment():
    """The last local rank gets the last block: a rank read as 0 would get the first."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    got = _child(None, None, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert got["bound"] == got["now"] == rank_cores(cores, 1, 2)
    assert got["bound"] != rank_cores(cores, 0, 2)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity only")
def test_without_torchruns_ranks_nothing_is_bound():
    """Only WORLD_SIZE set (another launcher): no rank is guessed, the cores stay as they were."""
    cores = sorted(os.sched_getaffinity(0))
    got = _child(None, None, {"WORLD_SIZE": "2", "RANK": "1"})
    assert got["bound"] is None
    assert got["now"] == cores
