"""The trainer's privacy budget, without spawning it: the steps it runs and the noise for them.

Reference: the accountant the trainer's engine uses (PRV), asked by hand about
``(noise, 1 / steps_per_epoch, steps run)``, as the optimizer's step hook records it.
"""

import pytest
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier
from torch.utils.data import DataLoader

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.train.config import TrainConfig
from opacus_fsdp_sync.train.privacy import noise_for_target, plan_steps
from opacus_fsdp_sync.train.session import datasets as _datasets

# PRV bounds its domain with RDP, which warns at small step counts; the epsilon is PRV's.
pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")

DELTA = 1e-5


def _steps_per_epoch(cfg: TrainConfig) -> int:
    """As the trainer sizes the loader it hands to make_private: after the held-out split."""
    train_set, _, _ = _datasets(cfg, vocab=64)
    return len(DataLoader(train_set, batch_size=cfg.batch_size))


def _epsilon(noise: float, sample_rate: float, steps: int) -> float:
    accountant = create_accountant(mechanism=PrivacyEngine().accountant.mechanism())
    accountant.history = [(noise, sample_rate, steps)]
    return accountant.get_epsilon(DELTA)


# 667 examples, batch 15 (40 steps per epoch) and batch 64 (10): Opacus's make_private_with_epsilon
# calibrated these for one step fewer than the trainer ran (e.g. 0.7 epochs: 27 steps, not 28).
@pytest.mark.parametrize("num_examples", [300, 667])
@pytest.mark.parametrize("batch_size", [15, 64])
@pytest.mark.parametrize("epochs", [0.3, 0.7])
def test_the_steps_run_never_exceed_the_target_epsilon(num_examples, batch_size, epochs):
    target = 4.0
    cfg = TrainConfig(
        num_examples=num_examples, batch_size=batch_size, epochs=epochs, target_epsilon=target
    )
    plan = plan_steps(steps_per_epoch=_steps_per_epoch(cfg), epochs=epochs, max_steps=None)
    noise = noise_for_target(target_epsilon=target, delta=DELTA, plan=plan, accountant="prv")
    eps = _epsilon(noise, plan.sample_rate, plan.total_steps)
    assert target - 0.05 <= eps <= target + 1e-6, (plan, noise, eps)


def test_the_issues_example_overshot_with_opacus_epochs_calibration():
    """667 examples, batch 15, 0.7 epochs, target 4: 4.029 before, at most 4 now."""
    cfg = TrainConfig(num_examples=667, batch_size=15, epochs=0.7, target_epsilon=4.0)
    plan = plan_steps(steps_per_epoch=_steps_per_epoch(cfg), epochs=0.7, max_steps=None)
    assert (plan.steps_per_epoch, plan.total_steps) == (40, 28)
    upstream = get_noise_multiplier(
        target_epsilon=4.0, target_delta=DELTA, sample_rate=plan.sample_rate, epochs=0.7,
        accountant="prv",
    )  # fmt: skip
    assert _epsilon(upstream, plan.sample_rate, plan.total_steps) > 4.02  # the old overshoot


def test_max_steps_below_the_epochs_is_what_the_noise_is_calibrated_for():
    cfg = TrainConfig(num_examples=667, batch_size=15, epochs=2.35, max_steps=30, target_epsilon=2)
    plan = plan_steps(steps_per_epoch=_steps_per_epoch(cfg), epochs=2.35, max_steps=30)
    assert plan.total_steps == 30  # not the epochs' 94
    noise = noise_for_target(target_epsilon=2.0, delta=DELTA, plan=plan, accountant="prv")
    assert 1.95 <= _epsilon(noise, plan.sample_rate, 30) <= 2.0 + 1e-6


def test_plan_steps_rounds_the_decimal_product_down_and_caps_it():
    assert plan_steps(steps_per_epoch=100, epochs=0.29, max_steps=None).total_steps == 29
    assert plan_steps(steps_per_epoch=40, epochs=0.7, max_steps=None).total_steps == 28
    assert plan_steps(steps_per_epoch=3, epochs=1 / 3, max_steps=None).total_steps == 1
    assert plan_steps(steps_per_epoch=15, epochs=2.0, max_steps=100).total_steps == 30
    assert plan_steps(steps_per_epoch=15, epochs=2.0, max_steps=7).total_steps == 7
    assert plan_steps(steps_per_epoch=93, epochs=1.0, max_steps=None).sample_rate == 1 / 93
    with pytest.raises(ValueError, match="makes no step"):
        plan_steps(steps_per_epoch=3, epochs=0.3, max_steps=None)
    with pytest.raises(ValueError, match="max_steps=0"):
        TrainConfig(max_steps=0)


def test_help_says_what_is_not_private_and_the_privacy_unit(capsys):
    from opacus_fsdp_sync.train.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse rewraps the epilog
    assert "Not private" in text and "computed without noise" in text
    assert "train loss" in text and "held-out loss" in text and "checkpoints hold" in text
    assert "Privacy unit: one example of the synthetic task" in text
    assert "one record (a line of .txt, a JSON line, a data set row)" in text
