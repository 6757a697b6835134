"""Engine options: validation and the keep-unsharded memory policy (its log says why)."""

import logging

import pytest
import torch

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.options import GhostOptions, decide_keep_unsharded

CPU = torch.device("cpu")


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="keep_unsharded='sometimes'"):
        GhostOptions(keep_unsharded="sometimes")
    with pytest.raises(ValueError, match="keep_unsharded_budget_bytes=-1"):
        GhostOptions(keep_unsharded_budget_bytes=-1)
    with pytest.raises(TypeError):
        PrivacyEngine(restricted=True)


def test_sync_optimization_off_turns_everything_off():
    eff = GhostOptions(sync_optimization=False, keep_unsharded=True).effective
    assert (eff.restricted_first_pass, eff.keep_unsharded) == (False, False)


@pytest.mark.parametrize(
    "extra, budget, expected", [(10 * 2**20, 20 * 2**20, True), (30 * 2**20, 20 * 2**20, False)]
)
def test_auto_policy_follows_the_budget_and_logs_why(caplog, extra, budget, expected):
    opts = GhostOptions(keep_unsharded="auto", keep_unsharded_budget_bytes=budget)
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        assert decide_keep_unsharded(opts, extra, CPU) is expected
    msg = caplog.records[-1].getMessage()
    assert msg.startswith(f"[Ghost] keep_unsharded=auto -> {'on' if expected else 'off'}")
    assert f"{extra / 2**20:.1f} MiB" in msg and f"{budget / 2**20:.1f} MiB" in msg


def test_user_choice_wins_over_budget(caplog):
    opts = GhostOptions(keep_unsharded=True, keep_unsharded_budget_bytes=0)
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        assert decide_keep_unsharded(opts, 2**30, CPU) is True
    assert "set by the user" in caplog.records[-1].getMessage()


def test_boolean_options_are_type_checked():
    with pytest.raises(ValueError, match="keep_unsharded=1"):
        GhostOptions(keep_unsharded=1)
    with pytest.raises(ValueError, match="one_backward='yes'"):
        GhostOptions(one_backward="yes")
