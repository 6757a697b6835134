"""The reported epsilon equals Opacus's accountant computed by hand for the steps taken.

Poisson sampling is on (Opacus's default), as the accounting assumes.
"""

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_accounting as wa


def _by_hand(accountant: str, q: float, steps: int) -> float:
    if accountant == "rdp":
        orders = RDPAccountant.DEFAULT_ALPHAS
        rdp = compute_rdp(q=q, noise_multiplier=wa.SIGMA, steps=steps, orders=orders)
        return get_privacy_spent(orders=orders, rdp=rdp, delta=wa.DELTA)[0]
    hand = PRVAccountant()
    hand.history = [(wa.SIGMA, q, steps)]
    return hand.get_epsilon(wa.DELTA)


def _check(res, accountant):
    q = wa.BATCH / wa.N  # the global sample rate, whatever the world size
    assert res["steps"] == wa.N // wa.BATCH
    assert res["history"] == [(wa.SIGMA, q, res["steps"])]
    hand = _by_hand(accountant, q, res["steps"])
    assert res["epsilon"] == pytest.approx(hand, rel=1e-9), (res["epsilon"], hand)
    assert hand > 0


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_single_device_epsilon_equals_the_accountant_by_hand(accountant):
    _check(wa.accounted_epoch(0, 1, "single", accountant), accountant)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2_rootless", "ddp_root"])
def test_distributed_epsilon_equals_the_accountant_by_hand(layout):
    for res in run_ranks(wa.accounted_epoch, 2, layout, "rdp", timeout=300):
        _check(res, "rdp")
