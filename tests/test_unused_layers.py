"""A hooked layer the forward skips in a step: its per-sample gradient is zero that step.

Reference: the clip-each-sample loop run with the same skips. Before per-step norms, a skipped
layer kept an earlier step's norms (over-clipping), and a layer skipped in the first step, or a
batch size that changed, crashed the step (one device and FSDP2).
"""

import copy
import warnings

import pytest
import torch

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads, run_ranks
from tests import workers_unused as wu
from tests.private import make_private

warnings.filterwarnings("ignore")
TOL = 1e-6
LR = 0.5
#: ``(what the forward skips, batch size)`` per step. ``stale``: the extra Linear used, then
#: skipped (it kept its norms: silent over-clipping); ``first_and_sizes``: unused in the first
#: step, a whole block later, batch sizes varying (crashed).
SCHEDULES = {
    "stale": [(set(), 8), ({"extra"}, 8)],
    "first_and_sizes": [({"extra"}, 8), (set(), 8), ({1}, 6), ({"extra", 1}, 5)],
}
OPTION_SETS = {
    "one_backward": dict(),  # the default
    "two_pass": dict(one_backward=False),
    "upstream_passes": dict(sync_optimization=False),
}


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_skipped_layers_on_one_device_equal_the_loop(name, schedule):
    steps = SCHEDULES[schedule]
    torch.manual_seed(0)
    base = wu.SkipNet()
    g = torch.Generator().manual_seed(3)
    n = sum(b for _, b in steps)
    x, y = torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)
    probe = copy.deepcopy(base)
    probe.skip = steps[0][0]
    _, norms0 = per_sample_clipped_grads(probe, wu.skip_sample_loss, x[:8], y[:8], 1.0)
    C = norms0.median().item()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    engine = PrivacyEngine(**OPTION_SETS[name])
    gsm, opt, crit, _ = make_private(engine, model, (x, y), 8, C, "ghost", lr=LR)
    assert engine.one_backward is (name == "one_backward")
    offset, clipped, total = 0, 0, 0
    for step, (skip, b) in enumerate(steps):
        xs, ys = x[offset : offset + b], y[offset : offset + b]
        offset += b
        model.skip, ref.skip = skip, skip
        # Opacus divides the clipped sum by the expected batch size, not this batch's.
        ref_norms = clip_each_sample_step(
            ref, wu.skip_sample_loss, xs, ys, C, LR / opt.expected_batch_size, "sum"
        )
        crit(gsm(xs), ys).backward()
        norms = gsm.per_sample_gradient_norms
        opt.step()
        opt.zero_grad()
        assert (ref_norms > C).any(), f"step {step}: clipping inactive"
        clipped, total = clipped + int((ref_norms > C).sum()), total + b
        assert norms.tolist() == pytest.approx(ref_norms.tolist(), rel=1e-5), step
        ours = {k: p.detach() for k, p in model.named_parameters()}
        assert _diff(ours, {k: p.detach() for k, p in ref.named_parameters()}) <= TOL, step
        if step == 0 and "extra" in skip:  # zero gradient, no noise (noise 0): unchanged
            assert (model.extra.weight == base.extra.weight).all()
    assert clipped < total
    assert _diff(ours, {k: p.detach() for k, p in base.named_parameters()}) > 1e-2


@pytest.mark.distributed
@pytest.mark.parametrize("one_backward", [True, False])
def test_skipped_layers_under_fsdp2_equal_the_loop(one_backward):
    """Two ranks; a whole FSDP unit and a layer of the root unit unused in the first step."""
    results = run_ranks(wu.unused_layers_fsdp2, 2, dict(one_backward=one_backward), timeout=120)
    for res in results:
        assert res["one_backward"] is one_backward
        assert res["skipped_unchanged"] and all(res["skipped_unchanged"])
        assert sum(s["clipped"] for s in res["steps"]) < sum(s["n"] for s in res["steps"])
        for step, s in enumerate(res["steps"]):
            assert s["clipped"] > 0, f"step {step}: clipping inactive"
            assert s["norms_rel_err"] <= 1e-5, step
            assert s["vs_loop"] <= TOL, step
        assert res["moved"] > 1e-2
