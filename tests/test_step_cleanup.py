"""A failed step cleans up everything whatever raised, never masks its own error, and every
fallback from the planned step is logged and reported.

One device (``grad_sample_mode="ghost"``); the controller is swapped for one that fails on
purpose. Exactness after a failure is judged against the clip-each-sample loop.
"""

import copy
import logging
import warnings

import pytest
import torch

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.apis import NullController
from opacus_fsdp_sync.errors import UnsupportedConfigurationError
from tests.models import Tripwire
from tests.private import make_private
from tests.test_single_device import B, _diff, _loop, toy_setup

warnings.filterwarnings("ignore")


@pytest.fixture()
def setup():
    return toy_setup()


class BrokenController(NullController):
    """A controller whose ``end_first_pass`` or ``abort`` raises while its flag is set."""

    def __init__(self, *, end_raises=False, abort_raises=False):
        self.end_raises, self.abort_raises = end_raises, abort_raises
        self.aborts = 0

    def end_first_pass(self):
        if self.end_raises:
            raise RuntimeError("end_first_pass broke")

    def abort(self):
        self.aborts += 1
        if self.abort_raises:
            raise RuntimeError("abort broke")


def _private(base, x, y, C, **kw):
    model = copy.deepcopy(base)
    engine = PrivacyEngine(**kw)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost")
    return engine, model, gsm, opt, crit


def _two_steps(gsm, opt, crit, x, y, combine=lambda loss: loss):
    for s in range(2):
        combine(crit(gsm(x[s * B : (s + 1) * B]), y[s * B : (s + 1) * B])).backward()
        opt.step()
        opt.zero_grad()


def _assert_clean_then_exact(model, gsm, opt, crit, base, x, y, C):
    assert all(p.grad is None for p in model.parameters())
    _two_steps(gsm, opt, crit, x, y)  # nothing of the failed step leaks into these
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert _diff(params, _loop(base, x, y, C)) <= 1e-6


@pytest.mark.parametrize("one_backward", [True, False])
def test_failing_abort_does_not_mask_the_error_or_skip_the_cleanup(setup, one_backward):
    base, x, y, C = setup
    engine, model, gsm, opt, crit = _private(base, x, y, C, one_backward=one_backward)
    broken = BrokenController(abort_raises=True)
    engine._context.controller = broken
    Tripwire.armed = True
    try:
        with pytest.raises(RuntimeError, match="tripwire") as info:
            crit(gsm(x[:B]), y[:B]).backward()
    finally:
        Tripwire.armed = False
    assert broken.aborts == 1
    assert [str(e) for e in info.value.cleanup_errors] == ["abort broke"]
    broken.abort_raises = False
    _assert_clean_then_exact(model, gsm, opt, crit, base, x, y, C)


def test_error_ending_a_successful_first_pass_is_cleaned_up(setup):
    base, x, y, C = setup
    engine, model, gsm, opt, crit = _private(base, x, y, C)
    broken = BrokenController(end_raises=True)
    engine._context.controller = broken
    with pytest.raises(RuntimeError, match="end_first_pass broke"):
        crit(gsm(x[:B]), y[:B]).backward()
    assert broken.aborts == 1
    broken.end_raises = False
    _assert_clean_then_exact(model, gsm, opt, crit, base, x, y, C)


@pytest.mark.parametrize("one_backward", [True, False])
def test_noise_draw_starts_after_the_first_pass_and_a_failed_start_is_cleaned_up(
    setup, one_backward, monkeypatch
):
    """The draw starts once the first pass has ended; if it cannot start, the step is undone."""
    base, x, y, C = setup
    engine, model, gsm, opt, crit = _private(base, x, y, C, one_backward=one_backward)
    calls = []

    class Recording(NullController):
        def end_first_pass(self):
            calls.append("end_first_pass")

        def abort(self):
            calls.append("abort")

    engine._context.controller = Recording()
    ops = engine._context.optimizer_ops
    draw = ops.prefetch_noise

    def failing_draw():
        calls.append("draw")
        raise RuntimeError("the draw broke")

    monkeypatch.setattr(ops, "prefetch_noise", failing_draw)
    with pytest.raises(RuntimeError, match="the draw broke"):
        crit(gsm(x[:B]), y[:B]).backward()
    assert calls == ["end_first_pass", "draw", "abort"]
    monkeypatch.setattr(ops, "prefetch_noise", draw)
    _assert_clean_then_exact(model, gsm, opt, crit, base, x, y, C)


@pytest.mark.parametrize("combine", ["add", "mul"])
def test_a_term_needing_gradients_is_refused_and_the_next_steps_are_exact(setup, combine):
    """``loss + reg`` took two passes whose second scaled the term's gradient by the data's
    clipping coefficients (one example then moved the update beyond C); now refused when
    combined, before any backward, and the engine steps on as before."""
    base, x, y, C = setup
    engine, model, gsm, opt, crit = _private(base, x, y, C)
    term = torch.zeros((), requires_grad=True)
    loss = crit(gsm(x[:B]), y[:B])
    with pytest.raises(UnsupportedConfigurationError, match=r"loss \+ reg.*weight_decay"):
        _ = loss + term if combine == "add" else loss * term
    _assert_clean_then_exact(model, gsm, opt, crit, base, x, y, C)
    assert engine.one_backward is True


def test_no_first_pass_source_falls_back_logged_and_reported(setup, caplog):
    base, x, y, C = setup
    engine, model, gsm, opt, crit = _private(base, x, y, C)
    xg = x.clone().requires_grad_()  # the first layer's input needs a gradient: no source
    with caplog.at_level(logging.WARNING, logger="opacus_fsdp_sync"):
        _two_steps(gsm, opt, crit, xg, y)
    assert engine.one_backward is False
    fallbacks = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(fallbacks) == 1 and "no first-pass source" in fallbacks[0], fallbacks
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert _diff(params, _loop(base, x, y, C)) <= 1e-6


def test_float_and_item_of_the_loss_agree(setup):
    base, x, y, C = setup
    _, _, gsm, _, crit = _private(base, x, y, C)
    loss = crit(gsm(x[:B]), y[:B])
    want = torch.nn.functional.cross_entropy(base(x[:B]), y[:B]).item()
    assert float(loss) == loss.item() == pytest.approx(want, rel=1e-6)
