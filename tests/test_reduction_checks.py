"""make_private refuses gradient reductions that do not average over ranks (a privacy break).

The DP optimizers add noise of std sigma * C / B to gradients they take as averaged over the
data-parallel ranks. An FSDP2 divide factor of 1.0 on 2 ranks, or a DDP hook that sums, doubles
the update and halves the effective noise multiplier, silently; PowerSGD's error feedback
carries unreleased per-rank clipped gradients into later steps.
"""

from __future__ import annotations

import torch

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_reduction as wr

_FIX = "default averaging"


def test_fsdp2_divide_factor_and_force_sum_are_refused_default_and_hsdp_pass():
    for res in run_ranks(wr.fsdp2_cases, 2, timeout=120):
        assert res["default"] is None
        assert res["hsdp_default"] is None
        for case, unit, what in [
            ("divide_1", "Sequential", "gradient_divide_factor=1.0"),
            ("force_sum", "'0' (", "force_sum_reduction_for_comms=True"),
            ("old_name", "'2' (", "gradient_divide_factor=2.0"),
        ]:
            msg = res[case]
            assert msg and msg.startswith("FSDP2 gradient reduction"), (case, msg)
            assert unit in msg and what in msg and _FIX in msg, (case, msg)
            assert "after make_private" in msg, msg
        assert "'0'" not in res["divide_1"] and "'2'" not in res["divide_1"]  # the root only
        assert res["missing_attr"].startswith("internals: "), res["missing_attr"]
        assert torch.__version__ in res["missing_attr"], res["missing_attr"]
        assert "force_sum_reduction_for_comms" in res["missing_attr"]


def test_ddp_hooks_other_than_averaging_are_refused():
    for res in run_ranks(wr.ddp_cases, 2, timeout=120):
        assert res["none"] is None
        assert res["allreduce"] is None
        for case, names in [
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
