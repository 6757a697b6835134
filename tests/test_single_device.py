"""One device (``grad_sample_mode="ghost"``): the engine is a drop-in and changes nothing."""

import copy
import logging
import warnings

import opacus
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine, SyncDPTensor
from opacus_fsdp_sync.profiling import StepTimer
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import ToyNet, toy_sample_loss
from tests.private import make_private

warnings.filterwarnings("ignore")
B = 8


def toy_setup():
    """A seeded ToyNet, two batches of data and a clipping bound that clips some samples."""
    torch.manual_seed(0)
    base = ToyNet()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2 * B, 16, generator=g), torch.randint(0, 8, (2 * B,), generator=g)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), toy_sample_loss, x[:B], y[:B], 1.0)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B
    return base, x, y, C


@pytest.fixture()
def setup():
    return toy_setup()


def _train(engine, base, x, y, C, steps=2, combine=None, **kw):
    model = copy.deepcopy(base)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost", **kw)
    forward = gsm if kw.get("wrap_model", True) else model  # hooks object is not callable
    losses = []
    for s in range(steps):
        loss = crit(forward(x[s * B : (s + 1) * B]), y[s * B : (s + 1) * B])
        if combine is not None:
            loss = combine(loss)
        losses.append(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _loop(base, x, y, C, steps=2):
    ref = copy.deepcopy(base)
    for s in range(steps):
        clip_each_sample_step(
            ref, toy_sample_loss, x[s * B : (s + 1) * B], y[s * B : (s + 1) * B], C, 0.5
        )
    return {n: p.detach() for n, p in ref.named_parameters()}


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


OPTION_SETS = {
    "upstream_passes": (dict(sync_optimization=False), True),
    "two_pass_restricted": (dict(one_backward=False, fast_norms=False), True),
    "two_pass_fast_norms": (dict(one_backward=False), False),
    "one_backward": (dict(), False),  # the default
}


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_ghost_equals_upstream_and_loop(setup, name):
    """Two-pass variants equal upstream bit for bit; one backward to fp32 rounding (1e-6)."""
    options, bit_exact = OPTION_SETS[name]
    base, x, y, C = setup
    engine = PrivacyEngine(**options)
    ours, losses = _train(engine, base, x, y, C)
    upstream, _ = _train(opacus.PrivacyEngine(), base, x, y, C)
    assert all(isinstance(loss, SyncDPTensor) for loss in losses)
    assert engine.one_backward is (name == "one_backward")
    if bit_exact:
        assert _diff(ours, upstream) == 0.0
    else:
        assert _diff(ours, upstream) <= 1e-6
    assert _diff(ours, _loop(base, x, y, C)) <= 1e-6
    assert _diff(ours, {n: p for n, p in base.named_parameters()}) > 1e-3


def test_make_private_keyword_overrides_engine(setup):
    base, x, y, C = setup
    engine = PrivacyEngine(sync_optimization=True)
    ours, _ = _train(engine, base, x, y, C, sync_optimization=False)
    assert engine.sync_api is None
    assert _diff(ours, _loop(base, x, y, C)) <= 1e-6


def test_wrap_model_false(setup):
    base, x, y, C = setup
    ours, losses = _train(PrivacyEngine(), base, x, y, C, wrap_model=False)
    upstream, _ = _train(opacus.PrivacyEngine(), base, x, y, C, wrap_model=False)
    assert isinstance(losses[0], SyncDPTensor)
    assert _diff(ours, upstream) <= 1e-6
    assert _diff(ours, _loop(base, x, y, C)) <= 1e-6


def test_loss_arithmetic_keeps_our_backward(setup):
    base, x, y, C = setup
    plain, _ = _train(PrivacyEngine(), base, x, y, C)
    combined, losses = _train(
        PrivacyEngine(), base, x, y, C, combine=lambda loss: (loss * 0.5 + 0.5 * loss) / 1.0
    )
    assert all(isinstance(loss, SyncDPTensor) for loss in losses)
    assert _diff(plain, combined) <= 1e-7


def test_make_private_with_epsilon(setup):
    base, x, y, _ = setup
    model = copy.deepcopy(base)
    engine = PrivacyEngine(timing=True)
    gsm, opt, crit, _ = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        sync_optimization=True,
    )
    assert opt.noise_multiplier > 0
    loss = crit(gsm(x[:B]), y[:B])
    assert isinstance(loss, SyncDPTensor)
    loss.backward()
    opt.step()
    assert set(engine.last_step_timings) == {
        "first_backward",
        "norms",
        "re-enable_sync",
        "weight_grads",
        "reduce_scatter",
    }
    assert engine.get_epsilon(1e-5) > 0


def test_unsupported_reduction_is_refused(setup):
    base, x, y, C = setup
    model = copy.deepcopy(base)
    gsm, opt, crit, _ = make_private(PrivacyEngine(), model, (x, y), B, C, "ghost", lr=0.1)
    loss = crit(gsm(x[:B]), y[:B])
    loss.loss_reduction = "max"
    with pytest.raises(ValueError, match="Only 'sum' and 'mean'"):
        loss.backward()


def test_timing_env_and_off_by_default(monkeypatch, caplog):
    monkeypatch.delenv("OPACUS_FSDP_SYNC_TIMING", raising=False)
    assert PrivacyEngine().timing is False
    monkeypatch.setenv("OPACUS_FSDP_SYNC_TIMING", "1")
    assert PrivacyEngine().timing is True
    off = StepTimer(enabled=False)
    with off.phase("x"):
        pass
    assert off.flush() == {} and off._pending == []
    on = StepTimer(enabled=True)
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        with on.phase("first_backward"):
            sum(range(1000))
        on.end_step()
    assert on.clock == "perf_counter"
    assert on.last_step["first_backward"] > 0
    assert any(r.getMessage().startswith("[Ghost] first_backward: ") for r in caplog.records)


@pytest.mark.parametrize("timing", [True, False])
def test_norms_phase_times_every_hooked_layer_once(setup, timing):
    """``norms``: one timed span per hooked layer per step, the upstream fallback included."""
    base, x, y, C = setup
    model = nn.Sequential(nn.Linear(16, 16), nn.GroupNorm(4, 16), nn.Linear(16, 8))
    engine = PrivacyEngine(timing=timing)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost")
    assert nn.GroupNorm not in gsm.NORM_SAMPLERS  # upstream's per-sample-gradient fallback
    timer = engine._context.timer
    names: list[str] = []
    original = timer.phase

    def spy(name):
        names.append(name)
        return original(name)

    timer.phase = spy
    for s in range(2):
        crit(gsm(x[s * B : (s + 1) * B]), y[s * B : (s + 1) * B]).backward()
        opt.step()
        opt.zero_grad()
        # The generic path re-ran the GroupNorm in the gradient phase with hooks off: it left
        # no first-pass source or captured layer behind for the next step.
        assert not gsm._sources and not gsm._captured
    assert names.count("norms") == (2 * 3 if timing else 0)
    assert (gsm._norm_timer is timer) is timing
    if timing:
        assert 0 < engine.last_step_timings["norms"] < engine.last_step_timings["first_backward"]


def test_unknown_grad_sample_mode_is_refused_naming_the_allowed_ones(setup):
    """Opacus would say ``Allowed values: hooks, ew`` only once it wraps the model."""
    from opacus_fsdp_sync.errors import UnsupportedConfigurationError

    base, x, y, C = setup
    model = copy.deepcopy(base)
    with pytest.raises(UnsupportedConfigurationError) as info:
        make_private(PrivacyEngine(), model, (x, y), B, C, "ghost_fsdp2")
    message = str(info.value)
    assert message.startswith("grad_sample_mode='ghost_fsdp2': choose one of 'ghost', 'ghost_fsdp'")
    assert "'hooks', 'functorch', 'ew'" in message
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())
    gsm, *_ = make_private(PrivacyEngine(), copy.deepcopy(base), (x, y), B, C, "hooks")
    assert isinstance(gsm, opacus.GradSampleModule)  # Opacus's own modes pass through


def test_a_draws_physical_batches_are_timed_as_one_step(setup, caplog):
    """``BatchMemoryManager``'s physical batches of one draw (every step but the last skipped)
    resolve their timings once, after the draw's last backward: no physical batch waits for the
    previous one's CUDA events, and the draw's phases are the batches' together. The test feeds
    its own halves of two fixed batches (what it checks is timing, not sampling)."""
    base, x, y, C = setup
    engine = PrivacyEngine(timing=True)
    gsm, opt, crit, _ = make_private(engine, copy.deepcopy(base), (x, y), B, C, "ghost")
    timer = engine._context.timer  # the engine's own timer: what is pending, unresolved
    lines = []
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        for draw in range(2):
            for half in range(2):
                opt.signal_skip_step(do_skip=half == 0)
                rows = slice(draw * B + half * B // 2, draw * B + (half + 1) * B // 2)
                crit(gsm(x[rows]), y[rows]).backward()
                opt.step()
                opt.zero_grad()
                lines.append(
                    sum("[Ghost] first_backward:" in r.getMessage() for r in caplog.records)
                )
                if half == 0:  # the first half's spans wait for the second's
                    assert {p.name for p in timer._pending} >= {"first_backward", "norms"}
    assert lines == [0, 1, 1, 2]  # one resolution per draw, none after a skipped step
    assert timer._pending == []  # the last draw resolved
    assert engine.optimizer_steps == 2
