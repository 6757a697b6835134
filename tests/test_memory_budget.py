"""The one-backward memory budget: checked before the first pass, exact on every path.

Reference: the clip-each-sample loop over the same Poisson draws (and the run without a budget),
tolerance 1e-6 in fp32; clipping is active (some per-sample norms above C) in every comparison.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.hooks.contract import KeptLayer
from opacus_fsdp_sync.one_backward.memory import plan_memory
from opacus_fsdp_sync.options import GhostOptions, auto_memory_budget
from opacus_fsdp_sync.profiling.memory import size_text
from opacus_fsdp_sync.testing import per_sample_clipped_grads, run_ranks
from tests import workers_memory_budget as wm
from tests.models import SharedInputSeqNet, seq_sample_loss
from tests.workers_memory_budget import CLASSES, KEPT, LR, PER_SAMPLE, STEPS, B, D, N, T

warnings.filterwarnings("ignore")


def _run(base, data, C, **options):
    """Poisson sampling (dp_seed: the same draws in every run), STEPS steps, noise 0."""
    model = copy.deepcopy(base)
    engine = PrivacyEngine(dp_seed=11, **options)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=C,
        grad_sample_mode="ghost",
    )
    steps = []
    for s, (xb, yb) in enumerate(loader):
        if s == STEPS:
            break
        n = xb.shape[0]
        crit(gsm(xb).reshape(-1, CLASSES), yb.reshape(-1), shape=(n, T)).backward()
        opt.step()
        opt.zero_grad()
        steps.append(
            dict(
                n=n,
                one=engine.one_backward,
                kept=engine.last_step_kept_bytes,
                plan=engine.last_step_memory,
                taken=gsm.per_sample_policy.taken,
                draw=engine.sampler.global_draw(s).tolist(),
            )
        )
    expected = engine.sampler.sample_rate * engine.sampler.num_samples
    return {k: p.detach().clone() for k, p in model.named_parameters()}, steps, expected


def _loop(base, data, draws, C, expected):
    """The clip-each-sample loop over the same draws, scaled as Opacus's optimizer scales."""
    ref = copy.deepcopy(base)
    clipped = 0
    for sel in draws:
        x, y = data.tensors[0][sel], data.tensors[1][sel]
        grads, norms = per_sample_clipped_grads(ref, seq_sample_loss, x, y, C, "sum")
        clipped += int((norms > C).sum())
        with torch.no_grad():
            for k, p in ref.named_parameters():
                p.sub_(LR * grads[k] / expected)
    return {k: p.detach() for k, p in ref.named_parameters()}, clipped


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    base = SharedInputSeqNet(D, CLASSES)
    data = wm.dataset()
    _, norms = per_sample_clipped_grads(
        copy.deepcopy(base), seq_sample_loss, *data.tensors[:2], 1.0
    )
    C = norms.median().item()
    free, steps, expected = _run(base, data, C)
    loop, clipped = _loop(base, data, [s["draw"] for s in steps], C, expected)
    assert clipped > 0 and clipped < sum(s["n"] for s in steps)  # clipping active
    assert _diff(free, loop) <= 1e-6
    assert all(s["one"] and s["plan"] is None for s in steps)  # CPU: no automatic limit
    assert [s["kept"] for s in steps] == [KEPT * s["n"] for s in steps]
    return base, data, C, free, loop, steps


def test_over_budget_takes_per_sample_gradients_exactly(setup, caplog):
    base, data, C, free, loop, ref_steps = setup
    sizes = [s["n"] for s in ref_steps]
    # Every step is over this budget, and all-per-sample fits every step.
    budget = PER_SAMPLE * max(sizes)
    assert budget < KEPT * min(sizes)
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        got, steps, _ = _run(base, data, C, one_backward_memory_budget=budget)
    assert [s["n"] for s in steps] == sizes  # the same draws
    for s in steps:
        plan = s["plan"]
        assert s["one"] and plan.outcome == "per-sample" and not plan.two_pass
        assert plan.needed == KEPT * s["n"] > budget >= plan.planned
        assert s["kept"] == plan.planned  # the estimate is what was kept
        assert s["taken"] == len(plan.per_sample) > 0
    assert _diff(got, free) <= 1e-6 and _diff(got, loop) <= 1e-6
    lines = [r for r in caplog.records if r.getMessage().startswith("[Ghost] memory:")]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING  # once over three steps
    first = steps[0]["plan"]
    for number in (first.needed, budget, first.planned):
        assert size_text(number) in lines[0].getMessage()
    assert "keep per-sample gradients instead" in lines[0].getMessage()


def test_a_smaller_budget_takes_the_two_pass_step_exactly(setup, caplog):
    base, data, C, free, loop, ref_steps = setup
    budget = PER_SAMPLE - 1  # not even one sample's per-sample gradients fit
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        got, steps, _ = _run(base, data, C, one_backward_memory_budget=budget)
    for s in steps:
        assert not s["one"] and s["plan"].two_pass and s["plan"].planned > budget
        assert s["taken"] == 0
    assert _diff(got, free) <= 1e-6 and _diff(got, loop) <= 1e-6
    lines = [r.getMessage() for r in caplog.records if "[Ghost] memory:" in r.getMessage()]
    assert len(lines) == 1 and "two backward passes" in lines[0], lines
    assert size_text(steps[0]["plan"].needed) in lines[0] and size_text(budget) in lines[0]


def test_within_the_budget_nothing_changes(setup):
    base, data, C, free, loop, ref_steps = setup
    got, steps, _ = _run(base, data, C, one_backward_memory_budget=KEPT * N)
    assert all(s["one"] and s["plan"].outcome == "fits" and s["taken"] == 0 for s in steps)
    assert _diff(got, free) == 0.0


def _layer(i, key, n_in, grad, psg):
    return KeptLayer(layer=i, inputs=((key, n_in),), grad_out=grad, per_sample=psg)


def test_the_plan_frees_a_shared_input_only_with_all_its_readers():
    # q, k, v read one 100-byte input; each saves 10 bytes alone; all three free the input too.
    layers = [_layer(i, "x", 100, 30, 20) for i in range(3)] + [_layer(3, "y", 50, 60, None)]
    assert plan_memory(layers, 10**6).outcome == "fits"
    plan = plan_memory(layers, 250 - 1)  # needed 100 + 90 + 50 + 60 = 300
    assert plan.needed == 300 and plan.per_sample == {0, 1, 2} and plan.planned == 170
    assert plan_memory(layers, 169).two_pass  # 50 + 60 + 3 x 20 is the least
    # A norm layer (no per-sample path) reads x too: x stays whatever q, k, v keep, and q's
    # per-sample gradients (35 bytes) are larger than its output gradient (30).
    layers = [_layer(0, "x", 100, 30, 35), _layer(1, "x", 100, 30, 20)]
    layers += [_layer(2, "x", 100, 30, 20), _layer(3, "x", 100, 40, None)]
    plan = plan_memory(layers, 210)  # needed 100 + 90 + 40 = 230
    assert plan.per_sample == {1, 2} and plan.planned == 210


def test_bad_budgets_are_refused_naming_the_option():
    for bad in (-1, 1.5, "8GiB", True):
        with pytest.raises(ValueError, match=r"one_backward_memory_budget=.*whole number of bytes"):
            GhostOptions(one_backward_memory_budget=bad)
        with pytest.raises(ValueError, match="tune_norms_memory_budget="):
            PrivacyEngine(tune_norms_memory_budget=bad)


def test_the_automatic_budget_is_free_cuda_memory_less_a_margin(monkeypatch):
    assert auto_memory_budget(torch.device("cpu")) is None
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 5 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 3 * gib)
    # 30 free + 2 cached unused - 8 (a tenth of 80 GiB)
    assert auto_memory_budget(torch.device("cuda", 0)) == 24 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1 * gib, 16 * gib))
    assert auto_memory_budget(torch.device("cuda", 0)) == 1 * gib  # 1 + 2 - 2 (the least)


@pytest.mark.distributed
def test_fsdp2_ranks_agree_and_stay_exact():
    """Rank 0 over its budget sends both ranks to two passes (rank 1 would fit: without the
    agreement their collectives differ); then per-sample gradients on both ranks."""
    results = run_ranks(wm.fsdp2_budgets, 2, timeout=180)
    r0, r1 = results
    assert r0["draws"] == r1["draws"]
    data = wm.dataset()
    torch.manual_seed(0)
    base = SharedInputSeqNet(D, CLASSES)
    loop, clipped = _loop(base, data, r0["draws"], wm.C, r0["expected"])
    assert clipped > 0
    assert [p["two_pass"] for p in r0["split"]] == [True] * wm.STEPS
    assert [(p["two_pass"], p["other_rank"]) for p in r1["split"]] == [(True, True)] * wm.STEPS
    assert all(p["outcome"] == "per-sample" for r in results for p in r["per_sample"])
    for r in results:
        assert _diff(r["params_split"], loop) <= 1e-6
        assert _diff(r["params_per_sample"], loop) <= 1e-6
