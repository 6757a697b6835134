"""The trainer's configuration and schedule, in process (no spawn)."""

import pytest

from opacus_fsdp_sync.train.config import TrainConfig
from opacus_fsdp_sync.train.optim import lr_factor


def test_lr_schedule_warms_up_then_decays_to_zero_at_the_last_step():
    cosine = TrainConfig(lr_schedule="cosine", warmup_steps=2)
    assert [lr_factor(cosine, 10, s) for s in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert lr_factor(cosine, 10, 6) == pytest.approx(0.5) and lr_factor(cosine, 10, 10) == 0.0
    linear = TrainConfig(lr_schedule="linear")
    assert [lr_factor(linear, 4, s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(TrainConfig(), 4, 3) == 1.0
    with pytest.raises(ValueError, match="lr_schedule='step'"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="optimizer='adam'"):
        TrainConfig(optimizer="adam")
