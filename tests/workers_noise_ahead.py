"""Rank functions for ``tests/test_noise_ahead.py``: checkpoints while noise is drawn ahead.

The DP optimizers draw a step's noise during its backward (a thread on CPU). A checkpoint
saved, or loaded, while such a draw is pending must neither replay nor skip-and-replay noise.
Noise multiplier 1e4: every update is the step's noise (scaled), so a replayed draw shows as
two equal updates.
"""

from __future__ import annotations

import time
import warnings

from tests.workers_randomness import _private, _steps

warnings.filterwarnings("ignore")

#: dp_seed: the runs are compared step for step (the test-only opt-in to reproducible noise).
SEED, NOISE = 11, 1e4


def reload_after_a_backward(rank: int, world: int, layout: str, path: str) -> dict:
    """Run A: four steps. Run B: two steps, a save, step 3's backward (its noise drawn ahead),
    no step, the checkpoint loaded in the same process, two more steps."""
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    a = _steps(*_private(layout, world, dp_seed=SEED, noise=NOISE)[1:], 4)
    engine, model, gsm, opt, crit, loader = _private(layout, world, dp_seed=SEED, noise=NOISE)
    b = _steps(model, gsm, opt, crit, loader, 2)
    save_checkpoint(path, gsm, opt, engine=engine)
    xb, yb = next(iter(loader))
    crit(gsm(xb), yb).backward()  # draws step 3's noise ahead
    time.sleep(1.0)  # lets the drawing thread finish before the load, as it mostly does
    opt.zero_grad()
    load_checkpoint(path, gsm, opt, engine=engine)
    b += _steps(model, gsm, opt, crit, loader, 2)
    return {"a": a, "b": b}


def save_while_drawing(rank: int, world: int, layout: str, path: str) -> dict:
    """A save between a backward and its step while the step's draw is still running (the
    draw is held back 0.5 s), then the step and a save after it: the two saved noise states."""
    import torch

    from opacus_fsdp_sync.sharding import save_checkpoint
    from opacus_fsdp_sync.sharding.dp_state import dp_state_path

    engine, model, gsm, opt, crit, loader = _private(layout, world, dp_seed=SEED, noise=NOISE)
    _steps(model, gsm, opt, crit, loader, 1)
    name = "_draw_noise" if hasattr(opt, "_draw_noise") else "_draw"  # FSDP / DDP optimizers
    draw = getattr(opt, name)

    def slow(*args):
        time.sleep(0.5)
        return draw(*args)

    setattr(opt, name, slow)
    xb, yb = next(iter(loader))
    crit(gsm(xb), yb).backward()
    save_checkpoint(path + "_mid", gsm, opt, engine=engine)
    opt.step()
    opt.zero_grad()
    save_checkpoint(path + "_post", gsm, opt, engine=engine)
    states = [
        torch.load(dp_state_path(path + suffix, rank), weights_only=False)["noise_generator"]
        for suffix in ("_mid", "_post")
    ]
    return {"mid": states[0], "post": states[1]}
