"""DDP takes the one-backward step: clipped gradients averaged in one bucketed all-reduce."""

import pytest

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_ddp_one_backward as wd

pytestmark = [pytest.mark.distributed]
TOL = 1e-6


def _total(counts, kind, key="count"):
    return sum(kinds.get(kind, {}).get(key, 0) for kinds in counts.values())


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_one_backward_exact_and_the_nonprivate_collectives(world):
    for res in run_ranks(wd.ddp_one_backward, world, timeout=600):
        assert 0 < res["clipped"] < res["n"]  # clipping is active
        # The path taken: one backward (the old code fell back to two passes here)
        assert res["one_used"] is True and res["two_used"] is False
        assert any("[Ghost] step: one backward" in r for r in res["records"]), res["records"]
        for t in res["one_timings"]:
            assert "weight_grads" in t and "all_reduce" in t and "second_backward" not in t, t
        # Exact: noise 0 against the two-pass DDP path and the clip-each-sample loop (fp32)
        assert res["one_vs_two"] <= TOL
        assert res["one_vs_loop"] <= TOL
        assert res["sum_used"] is True
        assert res["sum_one_vs_two"] <= TOL
        assert res["sum_one_vs_loop"] <= TOL
        # Noise on, same seed: the same step as the two-pass path
        assert res["noisy_moved"] > 1e-2
        assert res["noisy_one_vs_two"] <= TOL
        # Virtual steps (two micro-batches per step): the two-pass path's step, which is the
        # full batch's step
        assert res["acc_used"] is True
        assert res["acc_one_vs_two"] <= TOL
        assert res["acc_vs_full"] <= TOL
        # Collectives: exactly the non-private DDP step's all-reduces, count and bytes
        for one, two, plain, acc in zip(
            res["one_counts"], res["two_counts"], res["nonprivate_counts"], res["acc_counts"]
        ):
            print(f"world {world}: one {one} | two {two} | non-private {plain} | acc {acc}")
            assert "second_backward" not in one
            assert "all_reduce" not in one.get("first_backward", {})
            assert one["all_reduce"]["all_reduce"]["count"] == 1
            for key in ("count", "bytes"):
                assert _total(one, "all_reduce", key) == _total(plain, "all_reduce", key)
                assert _total(two, "all_reduce", key) == _total(plain, "all_reduce", key)
            assert _total(acc, "all_reduce") == 2  # one per micro-batch, as DDP would


@pytest.mark.parametrize(
    "ddp_kwargs",
    [{}, {"find_unused_parameters": True}, {"gradient_as_bucket_view": True}],
    ids=["default", "find_unused", "bucket_view"],
)
def test_ddp_reducer_stays_consistent_over_many_steps(ddp_kwargs):
    for res in run_ranks(wd.ddp_reducer_stays_consistent, 2, ddp_kwargs, timeout=300):
        assert res["used"] is True
        for counts in res["counts"]:
            assert _total(counts, "all_reduce") == 1  # ours; DDP's reducer issued none
            assert counts["all_reduce"]["all_reduce"]["count"] == 1
        # Afterwards a plain DDP backward is still averaged by DDP itself
        assert _total(res["plain_counts"], "all_reduce") >= 1
        assert res["plain_vs_global"] <= TOL


def test_ddp_several_buckets_and_a_comm_hook():
    for res in run_ranks(wd.ddp_buckets_and_comm_hook, 2, timeout=300):
        assert res["used"] is True
        assert res["vs_loop"] <= TOL
        # DDP's first iteration uses one bucket, then rebuilds buckets by gradient-ready order;
        # ours uses the rebuilt layout from the start
        for one, plain in list(zip(res["counts"], res["nonprivate_counts"]))[1:]:
            print(f"small buckets: one {one} | non-private {plain}")
            assert _total(one, "all_reduce") == _total(plain, "all_reduce") > 1
            assert _total(one, "all_reduce", "bytes") == _total(plain, "all_reduce", "bytes")
        # A communication hook is not emulated: DDP runs it in a second backward
        assert res["hook_used"] is False
        assert res["hook_vs_loop"] <= TOL
        assert any("a DDP communication hook" in r for r in res["records"]), res["records"]


def test_ddp_static_graph_is_refused_with_the_way_out():
    for msg in run_ranks(wd.ddp_static_graph_refused, 2, timeout=300):
        assert msg.startswith("UnsupportedConfigurationError: DDP static_graph=True"), msg
        assert "restricted_first_pass=False" in msg
