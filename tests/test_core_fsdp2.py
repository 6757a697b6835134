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


def _total(counts: dict, kind: str, field: str = "count") -> int:
    return sum(p.get(kind, {}).get(field, 0) for p in counts.values())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_option_set_equals_upstream_single_process_and_loop(world):
    """Sync skip alone, + keep unsharded, + activations-only first pass, and both."""
    results = run_ranks(workers_core.core_exactness, world, "fp32", timeout=400)
    for rank, res in enumerate(results):
        _assert_clipping_active(res)
        assert min(res["update_size"]) > 100 * FP32_TOL  # the steps really moved the parameters
        assert set(res["sets"]) == set(workers_core.OPTION_SETS)
        for name, r in res["sets"].items():
            assert r["one_backward"] is (name == "one_backward"), name
            if name in workers_core.BIT_EXACT:
                assert r["vs_upstream"] == [0.0, 0.0], f"{name}: must equal upstream bit for bit"
            else:
                assert max(r["vs_upstream"]) <= FP32_TOL, name
            assert max(r["vs_single"]) <= FP32_TOL, name
            assert max(r["vs_loop"]) <= FP32_TOL, name
            for step in range(2):
                ref = _local(res["ref_norms"][step], rank, workers_core.B_LOCAL)
                assert r["norms"][step] == pytest.approx(ref, rel=1e-5), name
            # Between the passes: no FSDPParam holds an unsharded gradient, user's flags back.
            for holds, flags in r["between"]:
                assert holds == 0, name
                assert all(tuple(f) == (True, True) for f in flags), name
            assert r["keep_unsharded"] is workers_core.OPTION_SETS[name]["keep_unsharded"]
        if world > 1:
            _assert_communication(res, world)
        _assert_first_pass_flops(res)


def _assert_communication(res, world):
    """Counted per step: what each option removes."""
    nodp_ag, nodp_rs = (
        _total(res["nodp_counts"], "all_gather"),
        _total(res["nodp_counts"], "reduce_scatter"),
    )
    for step, up in enumerate(res["upstream_counts"]):
        rs_up, ag_up = _total(up, "reduce_scatter"), _total(up, "all_gather")
        assert rs_up == 2 * nodp_rs > 0
        for name, r in res["sets"].items():
            ours = r["counts"][step]
            print(
                f"world {world} step {step} {name}: {ours} | upstream {up} | no_dp AG "
                f"{nodp_ag} RS {nodp_rs}"
            )
            assert "reduce_scatter" not in ours["first_backward"], name
            after = "reduce_scatter" if r["one_backward"] else "second_backward"
            assert ours[after]["reduce_scatter"]["count"] == nodp_rs, name
            assert _total(ours, "reduce_scatter") == nodp_rs, name  # 1 per unit
            if r["one_backward"]:  # no second backward: the non-private step's collectives
                assert "second_backward" not in ours, name
                assert _total(ours, "all_gather") == nodp_ag, name
            elif r["keep_unsharded"]:
                assert "all_gather" not in ours["second_backward"], name
                assert _total(ours, "all_gather") == nodp_ag, name  # the non-private count
            else:
                assert _total(ours, "all_gather") == ag_up, name


def _assert_first_pass_flops(res):
    """Activations-only first pass: no weight-gradient matmul, about half the FLOPs."""
    weights = {tuple(s) for s in res["weight_shapes"]} | {
        tuple(reversed(s)) for s in res["weight_shapes"]
    }
    full, restricted = res["sets"]["sync"], res["sets"]["restricted"]
    assert weights & {tuple(s) for s in full["matmuls"]["first_backward"]}  # the probe bites
    assert not weights & {tuple(s) for s in restricted["matmuls"]["first_backward"]}
    ratio = restricted["flops"]["first_backward"] / full["flops"]["first_backward"]
    print(f"first-backward FLOPs restricted/full: {ratio:.3f}")
    assert ratio < 0.6
    assert restricted["flops"]["second_backward"] == full["flops"]["second_backward"]
    one = res["sets"]["one_backward"]
    assert not weights & {tuple(s) for s in one["matmuls"]["first_backward"]}
    assert "second_backward" not in one["flops"]
    # weight gradients now come from one matmul per layer, outside any backward
    assert weights & {tuple(s) for s in one["matmuls"]["weight_grads"]}
    step = sum(one["flops"].values())
    two_pass = sum(restricted["flops"].values())
    print(f"step FLOPs one backward / two passes: {step / two_pass:.3f}")
    assert step < two_pass


def test_bf16_mixed_precision_equals_upstream():
    for res in run_ranks(workers_core.core_exactness, 2, "bf16", timeout=400):
        _assert_clipping_active(res)
        for name, r in res["sets"].items():
            if name in workers_core.BIT_EXACT:
                assert r["vs_upstream"] == [0.0, 0.0], name
            else:  # bf16 weight gradients computed by another op order than autograd's
                assert max(r["vs_upstream"]) <= BF16_TOL, name
            assert max(r["vs_loop"]) <= BF16_TOL, name
            for holds, _ in r["between"]:
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
        # Every group's sync back on (the first pass had turned it off): root and three blocks.
        assert [tuple(f) for f in after["flags"]] == [(True, True)] * 4
        assert res["vs_loop"] <= FP32_TOL


def test_tiny_llama_trains_and_logs_ghost_timings():
    res = run_ranks(workers_core.tiny_llama_trains, 2, timeout=300)[0]
    losses = res["losses"]
    assert losses[-1] < 0.9 * losses[0], losses
    records = res["records"]
    enabled = "[Ghost] FSDP2 optimization enabled: disabling gradient sync for first backward"
    assert records.count(enabled) == 1
    assert "[Ghost] step: one backward (clipped weight gradients from the first pass)" in records
    phases = ("first_backward", "norms", "re-enable_sync", "weight_grads", "reduce_scatter")
    for name in phases:
        lines = [r for r in records if r.startswith(f"[Ghost] {name}: ") and r.endswith(" ms")]
        assert len(lines) == len(losses)
    assert set(res["timings"]) == set(phases)
    # The norm hooks run inside the first backward: their time is part of it.
    assert 0 < res["timings"]["norms"] < res["timings"]["first_backward"]
