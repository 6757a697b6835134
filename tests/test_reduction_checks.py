"""make_private refuses gradient reductions that do not average over ranks (a privacy break).

The DP optimizers add noise of std sigma * C / B to gradients they take as averaged over the
data-parallel ranks. An FSDP2 divide factor of 1.0 on 2 ranks, or a DDP or FSDP1 hook that sums,
doubles the update and halves the effective noise multiplier, silently; PowerSGD's error
feedback carries unreleased per-rank clipped gradients into later steps; an averaging hook on a
subgroup leaves the ranks' updates apart, each with noise scaled for all of them.
"""

from __future__ import annotations

import pytest
import torch

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_reduction as wr

_FIX = "default averaging"


@pytest.mark.distributed
def test_fsdp2_divide_factor_custom_comm_and_hooks_are_refused_defaults_pass():
    for res in run_ranks(wr.fsdp2_cases, 2, timeout=120):
        for case in ("default", "hsdp_default", "force_sum", "pg_alloc"):
            assert res[case] is None, (case, res[case])
        for case, unit, what in [
            ("divide_1", "Sequential", "gradient_divide_factor=1.0"),
            ("force_sum_factor", "'0' (", "force_sum_reduction_for_comms=True"),
            ("old_name", "'2' (", "gradient_divide_factor=2.0"),
            ("custom_rs", "'2' (", "set_custom_reduce_scatter(_Summing)"),
            ("all_reduce_hook", "'0' (", "set_all_reduce_hook(_double)"),
        ]:
            msg = res[case]
            assert msg and msg.startswith("FSDP2 gradient reduction"), (case, msg)
            assert unit in msg and what in msg and _FIX in msg, (case, msg)
            assert "after make_private" in msg, msg
        assert "'0'" not in res["divide_1"] and "'2'" not in res["divide_1"]  # the root only
        assert "set_custom_reduce_scatter(" not in res["divide_1"], res["divide_1"]
        msg = res["sub_mesh"]
        assert msg and msg.startswith(f"FSDP2 units on a mesh that does not span all {2} ranks")
        assert "mesh of 1 ranks" in msg and "'tp'" in msg, msg
        for case in ("missing_attr", "missing_hook_attr"):
            assert res[case].startswith("internals: "), res[case]
            assert torch.__version__ in res[case], res[case]
            assert "force_sum_reduction_for_comms" in res[case], res[case]


@pytest.mark.distributed
def test_fsdp2_force_sum_alone_still_averages():
    """torch sums and then divides by the data-parallel size: the same noised update."""
    for res in run_ranks(wr.fsdp2_force_sum_step, 2, timeout=120):
        assert res["moved"] > 1e-3, res  # the step did change the parameters
        assert res["max_diff"] < 1e-6, res


@pytest.mark.distributed
def test_fsdp1_hooks_other_than_averaging_are_refused():
    for res in run_ranks(wr.fsdp1_cases, 2, timeout=120):
        for case in ("none", "reduce_scatter", "allreduce_no_shard"):
            assert res[case] is None, (case, res[case])
        for case, names in [
            ("sum", ["reduce_scatter_hook (DefaultState)"]),
            ("fp16", ["fp16_compress_hook (LowPrecisionState)"]),
        ]:
            msg = res[case]
            assert msg and msg.startswith("FSDP1 communication hook"), (case, msg)
            assert all(n in msg for n in names), (case, msg)
            assert "DefaultState(<the FSDP process group>)" in msg, msg
        assert res["missing_attr"].startswith("internals: "), res["missing_attr"]
        assert "_comm_hook" in res["missing_attr"], res["missing_attr"]


@pytest.mark.distributed
def test_ddp_hooks_other_than_averaging_are_refused():
    for res in run_ranks(wr.ddp_cases, 2, timeout=120):
        for case in ("none", "allreduce", "allreduce_world"):
            assert res[case] is None, (case, res[case])
        for case, names in [
            ("allreduce_subgroup", ["allreduce_hook", "other than DDP's"]),
            ("sum", ["_sum_hook", "may sum"]),
            ("powersgd", ["powerSGD_hook", "error feedback"]),
            ("fp16", ["fp16_compress_hook", "16 bits"]),
            ("builtin", ["ALLREDUCE", "built-in"]),
        ]:
            msg = res[case]
            assert msg and msg.startswith("DDP communication hook"), (case, msg)
            assert all(n in msg for n in names), (case, msg)
            assert "allreduce_hook" in msg and "after make_private" in msg, msg
        assert res["missing_attr"].startswith("internals: "), res["missing_attr"]
        assert torch.__version__ in res["missing_attr"]
        msg = res["ddp_on_subgroup"]
        assert msg and msg.startswith("DDP on a process group of 1 of the 2 ranks"), msg


@pytest.mark.distributed
def test_fsdp2_sync_turned_off_is_refused_before_anything_changes():
    """FSDP2's own accumulation (sync off) kept this backward's clipped gradients unreduced and
    added them to the next step's: that step moved 0.06 away from a run without the backward."""
    plain = run_ranks(wr.fsdp2_sync_off, 2, None, timeout=120)
    for setting in ("set_requires_gradient_sync", "set_requires_all_reduce"):
        for res, ref in zip(run_ranks(wr.fsdp2_sync_off, 2, setting, timeout=120), plain):
            assert res["error"] and res["error"].startswith("FSDP2 gradient accumulation ("), res
            assert f"{setting}(False)" in res["error"], res["error"]
            assert "BatchMemoryManager" in res["error"], res["error"]
            assert ref["update"].abs().max() > 1e-3  # the step after it moved the model
            assert torch.equal(res["update"], ref["update"]), setting
