"""The core: FSDP2 ghost clipping without first-pass reduce-scatter, exact.

References: upstream Opacus ``ghost_fsdp`` (same seed), single-process Opacus ``ghost`` on the
concatenated global batch, and the explicit clip-each-sample loop (the final word).
"""

import pytest

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_core

pytestmark = [pytest.mark.distributed]
FP32_TOL = 1e-6
# bf16 params (8-bit mantissa) with fp32 reduce against the fp32 loop: upstream Opacus shows the
# identical deviation (asserted bit-equal below), so this bounds bf16 arithmetic, not our change.
BF16_TOL = 0.1


def _assert_clipping_active(res):
    C = res["C"]
    for step, norms in enumerate(res["ref_norms"]):
        clipped = sum(n > C for n in norms)
        assert 0 < clipped < len(norms), f"step {step}: {clipped}/{len(norms)} clipped (C={C})"


def _local(norms, rank, b):
    return norms[rank * b : (rank + 1) * b]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp32_equals_upstream_single_process_and_loop(world):
    results = run_ranks(workers_core.core_exactness, world, "fp32", timeout=300)
    for rank, res in enumerate(results):
        _assert_clipping_active(res)
        assert res["ours_vs_upstream"] == [0.0, 0.0], "must equal upstream ghost_fsdp bit for bit"
        assert max(res["ours_vs_single"]) <= FP32_TOL
        assert max(res["ours_vs_loop"]) <= FP32_TOL
        assert min(res["update_size"]) > 100 * FP32_TOL  # the steps really moved the parameters
        for step in range(2):
            ref = _local(res["ref_norms"][step], rank, workers_core.B_LOCAL)
            assert res["ours_norms"][step] == pytest.approx(ref, rel=1e-5)
        # Between the passes: no FSDPParam holds an unsharded gradient, user's sync flags back.
        for holds, flags in res["between"]:
            assert holds == 0
            assert all(tuple(f) == (True, True) for f in flags)
        if world > 1:
            _assert_communication(res, world)


def _assert_communication(res, world):
    """Zero reduce-scatters in the first backward; the second issues upstream's per-pass count."""
    for ours, up in zip(res["ours_counts"], res["upstream_counts"]):
        print(f"world {world} ours per phase: {ours}\nupstream per step: {up}")
        rs_up = sum(p.get("reduce_scatter", {}).get("count", 0) for p in up.values())
        ag_up = sum(p.get("all_gather", {}).get("count", 0) for p in up.values())
        ag_ours = sum(p.get("all_gather", {}).get("count", 0) for p in ours.values())
        rs_ours = sum(p.get("reduce_scatter", {}).get("count", 0) for p in ours.values())
        assert "reduce_scatter" not in ours["first_backward"]
        assert ours["second_backward"]["reduce_scatter"]["count"] * 2 == rs_up > 0
        assert rs_ours * 2 == rs_up
        assert ag_ours == ag_up


def test_bf16_mixed_precision_equals_upstream():
    for res in run_ranks(workers_core.core_exactness, 2, "bf16", timeout=300):
        _assert_clipping_active(res)
        assert res["ours_vs_upstream"] == [0.0, 0.0]
        assert max(res["ours_vs_loop"]) <= BF16_TOL
        for holds, _ in res["between"]:
            assert holds == 0


def test_gradient_accumulation_equals_one_batch():
    for res in run_ranks(workers_core.accumulation, 2, timeout=300):
        assert max(res["accum_vs_one"]) <= FP32_TOL
        assert max(res["accum_vs_loop"]) <= FP32_TOL


def test_failed_first_backward_restores_sync_and_next_steps_are_exact():
    for res in run_ranks(workers_core.failure_recovery, 2, timeout=300):
        after = res["after_failure"]
        assert after["error"] == "tripwire: injected failure in backward"
        assert after["holds"] == 0
        assert after["hooks_enabled"]
        # Group order: root, blocks[0] (user had set sync off), blocks[1], blocks[2].
        assert [tuple(f) for f in after["flags"]] == [
            (True, True),
            (False, False),
            (True, True),
            (True, True),
        ]
        assert res["vs_loop"] <= FP32_TOL


def test_tiny_llama_trains_and_logs_ghost_timings():
    res = run_ranks(workers_core.tiny_llama_trains, 2, timeout=300)[0]
    losses = res["losses"]
    assert losses[-1] < 0.9 * losses[0], losses
    records = res["records"]
    enabled = "[Ghost] FSDP2 optimization enabled: disabling gradient sync for first backward"
    assert records.count(enabled) == 1
    for name in ("first_backward", "re-enable_sync", "second_backward"):
        lines = [r for r in records if r.startswith(f"[Ghost] {name}: ") and r.endswith(" ms")]
        assert len(lines) == len(losses)
    assert set(res["timings"]) == {"first_backward", "re-enable_sync", "second_backward"}
