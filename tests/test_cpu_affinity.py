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

from opacus_fsdp_sync.distributed.cpu_affinity import (
    holds_whole_cores,
    parse_cpu_list,
    physical_cores,
    rank_cores,
    read_siblings,
)


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
        assert got["bound"] == rank_cores(cores, r, world, read_siblings(cores))
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


def _far_apart(n: int) -> dict[int, frozenset[int]]:
    """``2 n`` logical CPUs whose hyperthread siblings are ``i`` and ``i + n`` (x86 servers)."""
    return {c: frozenset({c % n, c % n + n}) for c in range(2 * n)}


def test_siblings_far_apart_go_to_the_same_rank():
    """Blocks of adjacent ids would give rank 0 cores 0-3 and rank 1 their own siblings 4-7."""
    siblings = _far_apart(4)
    blocks = [rank_cores(list(range(8)), r, 2, siblings) for r in range(2)]
    assert blocks == [[0, 1, 4, 5], [2, 3, 6, 7]]
    adjacent = {c: frozenset({c - c % 2, c - c % 2 + 1}) for c in range(8)}
    assert [rank_cores(list(range(8)), r, 2, adjacent) for r in range(2)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_a_cpuset_keeps_only_its_siblings_and_few_physical_cores_fall_back_to_logical():
    siblings = _far_apart(4)
    cpuset = [0, 1, 2, 3, 4, 5]  # cores 2 and 3 without their siblings 6 and 7
    assert physical_cores(cpuset, siblings) == [[0, 4], [1, 5], [2], [3]]
    # whole cores would give four CPUs and two: logical blocks of three each instead
    assert [rank_cores(cpuset, r, 2, siblings) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]
    # with one more core left out, whole cores split evenly: [0, 4] + [1] against [2] + [3]
    assert [rank_cores([0, 1, 2, 3, 4], r, 2, siblings) for r in range(2)] == [[0, 1, 4], [2, 3]]
    # two physical cores for four ranks: each rank its own logical CPU
    two = _far_apart(2)
    assert [rank_cores([0, 1, 2, 3], r, 4, two) for r in range(4)] == [[0], [1], [2], [3]]


def test_the_topology_is_read_from_linux_cpu_lists(tmp_path):
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    for cpu, text in ((0, "0,2\n"), (1, "1,3\n"), (2, "0,2\n"), (3, "1,3\n")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text)
    siblings = read_siblings([0, 1, 2, 3], tmp_path)
    assert siblings == {0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {1, 3}}
    assert rank_cores([0, 1, 2, 3], 1, 2, siblings) == [1, 3]
    assert read_siblings([0, 4], tmp_path) is None  # cpu4's file is missing: no topology


def test_whole_cores_that_would_split_unevenly_give_logical_blocks():
    """Three two-thread cores for two ranks: whole cores would give four CPUs and two (the rank
    with four waits for the other at every collective); logical blocks give three each."""
    adjacent = {c: frozenset({c - c % 2, c - c % 2 + 1}) for c in range(6)}
    assert [rank_cores(list(range(6)), r, 2, adjacent) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert holds_whole_cores([0, 1, 2], list(range(6)), adjacent) is False  # core 1's 3 is not
    far = _far_apart(4)
    assert holds_whole_cores(rank_cores(list(range(8)), 0, 2, far), list(range(8)), far) is True
    assert holds_whole_cores([0, 1], list(range(8)), None) is None
    assert holds_whole_cores([0], [0, 1], {0: frozenset({0}), 1: frozenset({1})}) is True
