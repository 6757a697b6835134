"""Ghost clipping under FSDP1 (use_orig_params=True): works, exact, no first-pass collectives.

These run the default step (one backward); tests/test_fsdp1_one_backward.py compares it with the
two-pass step and the non-private step's collectives.
"""

import pytest

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_fsdp1

pytestmark = [pytest.mark.distributed]
STRATEGIES = ["full", "shard_grad_op", "no_shard"]
TOL = 1e-6
BF16_TOL = 0.1  # bf16 parameters against the fp32 loop (same bound as the FSDP2 tests)


def _count(counts, kind, phase=None):
    phases = [phase] if phase else list(counts)
    return sum(counts.get(p, {}).get(kind, {}).get("count", 0) for p in phases)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_strategy_equals_the_clip_each_sample_loop(world):
    for res in run_ranks(workers_fsdp1.fsdp1_exactness, world, STRATEGIES, timeout=400):
        assert 0 < res["clipped"] < res["n"]
        for strategy, r in res["results"].items():
            assert r["vs_loop"] <= TOL, strategy
            assert r["one_backward"] is True, strategy  # the default path under FSDP1
            if world == 1:
                continue
            for counts in r["counts"]:
                assert "second_backward" not in counts, (strategy, counts)
                for kind in ("reduce_scatter", "all_reduce"):  # first pass: nothing reduced
                    assert _count(counts, kind, "first_backward") == 0, (strategy, kind)
                # the hand-off re-gathers nothing and is the only place gradients are reduced
                assert _count(counts, "all_gather", "reduce_scatter") == 0, strategy
                reduced = _count(counts, "reduce_scatter") + _count(counts, "all_reduce")
                assert (
                    reduced
                    == _count(counts, "reduce_scatter", "reduce_scatter")
                    + _count(counts, "all_reduce", "reduce_scatter")
                    > 0
                ), strategy


def test_tied_and_bf16():
    tied = run_ranks(workers_fsdp1.fsdp1_exactness, 2, ["full"], 2, True, timeout=300)
    for res in tied:
        assert res["results"]["full"]["vs_loop"] <= TOL
    bf16 = run_ranks(workers_fsdp1.fsdp1_exactness, 2, STRATEGIES, 2, False, "bf16", timeout=300)
    for res in bf16:
        for strategy, r in res["results"].items():
            assert r["vs_loop"] <= BF16_TOL, strategy


def test_no_shard_with_noise_keeps_ranks_identical():
    res = run_ranks(
        workers_fsdp1.fsdp1_exactness, 2, ["no_shard"], 2, False, "fp32", 1.0, timeout=300
    )
    a, b = (r["results"]["no_shard"]["vs_loop"] for r in res)
    assert a == b > 1e-3  # noise moved the parameters, identically on both ranks


def test_unsupported_fsdp1_combinations_are_refused_clearly():
    res = run_ranks(workers_fsdp1.fsdp1_refusals, 2, timeout=300)[0]
    assert "HYBRID_SHARD" in res["hybrid"] and "hybrid_full" in res["hybrid"]
    assert "activations-only first pass" in res["upstream_passes"]
    assert "use FSDP2" in res["upstream_passes"]
    assert "use_orig_params=True" in res["flat_params"]
    # two roots leave the parameters between them outside every instance: the layout check
    # refuses first, naming them and the one-root fix
    assert "lie outside every FullyShardedDataParallel instance" in res["two_roots"]
    assert "FullyShardedDataParallel(model, ...)" in res["two_roots"]
