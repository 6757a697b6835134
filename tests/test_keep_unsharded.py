"""``keep_unsharded="auto"`` keeps parameters unsharded only where a second pass re-gathers them.

The one-backward hand-off never gathers parameters again: holding every unsharded parameter
through the first backward would cost (N-1)/N of the model per rank for nothing.
"""

import pytest

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_layouts as wl

pytestmark = [pytest.mark.distributed]


def test_auto_keeps_nothing_unsharded_for_one_backward():
    for res in run_ranks(wl.keep_unsharded_plan, 2, timeout=300):
        assert res["one_backward"]["one"] and not res["two_passes"]["one"], res
        assert res["one_backward"]["keep"] is False, res
        assert res["two_passes"]["keep"] is True, res  # a tiny model fits the budget
        for case in res.values():
            assert case["vs_loop"] <= 1e-6, res
