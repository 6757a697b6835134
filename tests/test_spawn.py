"""The rank harness (``opacus_fsdp_sync.testing.run_ranks``): start methods, environment, errors."""

from __future__ import annotations

import pytest

import tests.workers_misc as wm
from opacus_fsdp_sync.testing import spawn
from opacus_fsdp_sync.testing.spawn import RankFailure, run_ranks

PROBE = "OFS_TEST_RANK_PROBE"


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_at_each_call(monkeypatch, method):
    """A fork server's children would see the server's environment, fixed at its start."""
    monkeypatch.setenv(spawn.START_ENV, method)
    monkeypatch.setenv(PROBE, "first")
    first = run_ranks(wm.environment_probe, 2, PROBE, timeout=120)
    monkeypatch.setenv(PROBE, "second")
    second = run_ranks(wm.environment_probe, 2, PROBE, timeout=120)
    assert [r["value"] for r in first] == ["first", "first"]
    assert [r["value"] for r in second] == ["second", "second"]
    assert [r["rank"] for r in second] == [0, 1]
    assert spawn._rank_context().get_start_method() == method
    # the ranks really came from the fork server (its preload), or from fresh interpreters
    assert all(r["preloaded"] == (method == "forkserver") for r in first + second)


@pytest.mark.distributed
def test_a_rank_that_raises_is_reported_with_its_traceback():
    with pytest.raises(RankFailure, match="rank 1 raised:(.|\n)*rank one fails on purpose"):
        run_ranks(wm.raise_on_rank_one, 2, timeout=120)


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv(spawn.START_ENV, "fork")
    with pytest.raises(ValueError, match="OFS_RANKS_START='fork': choose 'forkserver' or 'spawn'"):
        run_ranks(wm.raise_on_rank_one, 2)
