"""DDP and DPDDP with ghost clipping: one all-reduce per step, exact, noise shared correctly."""

import pytest

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_ddp

pytestmark = [pytest.mark.distributed]
TOL = 1e-6


def _count(counts, kind, phase=None):
    phases = [phase] if phase else list(counts)
    return sum(counts.get(p, {}).get(kind, {}).get("count", 0) for p in phases)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_one_all_reduce_per_step_and_exact(world):
    for res in run_ranks(workers_ddp.ddp_exactness, world, timeout=300):
        assert 0 < res["clipped"] < res["n"]
        assert res["opt"] == "SharedNoiseDPOptimizer"
        assert res["ours_vs_loop"] <= TOL
        assert res["ours_vs_upstream"] <= TOL
        # Noise on: every rank adds rank 0's draw: equal to one process with the same generator.
        assert res["noisy_moved"] > 1e-2
        assert res["noisy_vs_single"] <= TOL
        assert res["noisy_drawn_ahead"] == 2  # both steps' noise drawn during the backward
        assert res["dpddp_vs_loop"] <= TOL
        if world > 1:
            for ours, up in zip(res["counts"], res["upstream_counts"]):
                print(f"world {world}: ours {ours} | upstream {up}")
                assert _count(ours, "all_reduce", "first_backward") == 0
                assert _count(ours, "all_reduce") == 1  # DDP's one bucket, in the clipped pass
                assert _count(up, "all_reduce") > _count(ours, "all_reduce")


def test_ddp_tied_llama_equals_loop():
    for res in run_ranks(workers_ddp.ddp_tied_llama, 2, timeout=300):
        assert 0 < res["clipped"] < res["n"]
        assert res["opt"] == "SharedNoiseDPOptimizer"
        assert res["one_backward"] is True  # tied weights, RMSNorm: the DDP hand-off
        assert res["vs_loop"] <= 1e-5


def test_user_no_sync_is_refused_with_the_way_out():
    for msg in run_ranks(workers_ddp.ddp_no_sync_refused, 2, timeout=300):
        assert msg.startswith("UnsupportedConfigurationError: DDP no_sync()")
        assert "BatchMemoryManager" in msg and "signal_skip_step" not in msg
