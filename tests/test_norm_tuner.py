"""The norm tuner: measured choices, cached per key, agreed across ranks, and always exact."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers.linear import LinearRoom
from opacus_fsdp_sync.profiling import StepTimer
from opacus_fsdp_sync.profiling.memory import size_text
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads, run_ranks
from opacus_fsdp_sync.tuning import (
    Candidate,
    Choice,
    NormKey,
    NormTuner,
    sensible_blocks,
    tuning_wanted,
)
from tests import workers_tuner
from tests.models import SharedInputSeqNet, seq_sample_loss
from tests.private import capture_ghost_log, make_private

warnings.filterwarnings("ignore")
B, T, D, CLASSES = 6, 10, 16, 8


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    base = SharedInputSeqNet(D)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * B, T, D, generator=g), torch.randint(0, CLASSES, (2 * B, T), generator=g)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), seq_sample_loss, x[:B], y[:B], 1.0)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B  # clipping active
    return base, x, y, C


def _private(base, C, **options):
    model = copy.deepcopy(base)
    engine = PrivacyEngine(**options)
    x0, y0 = torch.zeros(B, T, D), torch.zeros(B, T, dtype=torch.long)
    gsm, opt, crit, _ = make_private(engine, model, (x0, y0), B, C, "ghost")
    return model, gsm, opt, crit


def _step(gsm, opt, crit, xs, ys):
    logits = gsm(xs)
    n, t = xs.shape[:2]
    crit(logits.reshape(-1, CLASSES), ys.reshape(-1), shape=(n, t)).backward()
    opt.step()
    opt.zero_grad()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _loop(base, x, y, C, steps=2):
    ref = copy.deepcopy(base)
    for s in range(steps):
        clip_each_sample_step(
            ref, seq_sample_loss, x[s * B : (s + 1) * B], y[s * B : (s + 1) * B], C, 0.5
        )
    return _params(ref)


#: Injected costs (ms): per-sample gradients win for gate/up (12 -> 20), 4-token blocks for
#: down (20 -> 8), full Grams for q/k/v (16 -> 12).
def _injected(key: NormKey, cand: Candidate) -> float:
    if cand.per_sample:
        return 1.0 if key.d_out == 20 else 5.0
    if key.d_in == 20:
        return {0: 3.0, 4: 2.0}.get(cand.block, 4.0)
    return {0: 2.0, 4: 3.0}.get(cand.block, 4.0)


def test_injected_costs_pick_the_expected_strategy(setup):
    base, x, y, C = setup
    model, gsm, opt, crit = _private(base, C, tune_norms=True)
    tuner = gsm.norm_tuner
    tuner.blocks, tuner.cost_fn = (4,), _injected
    records = capture_ghost_log()
    _step(gsm, opt, crit, x[:B], y[:B])
    plan = {(k.d_in, k.d_out, k.bias): c for k, c in tuner.table.items()}
    assert plan == {
        (20, 8, True): Choice(block=4),
        (12, 20, False): Choice(block=0, per_sample=True),
        (12, 20, True): Choice(block=0, per_sample=True),
        (16, 12, True): Choice(block=0),
        (16, 12, False): Choice(block=0),
    }
    assert gsm.per_sample_policy.taken == 2  # gate and up took per-sample gradients
    assert {k.readers for k in tuner.table} == {1, 2, 3}  # down alone, gate/up, q/k/v
    assert sum(r.startswith("[Ghost] norm plan: 5 new entries") for r in records) == 1
    _step(gsm, opt, crit, x[B:], y[B:])
    assert sum(r.startswith("[Ghost] norm plan") for r in records) == 1  # logged once


def test_layers_sharing_an_input_take_one_block():
    """q (bias) prefers 4-token blocks alone, k/v full Grams; together blocks cost less."""
    tuner = NormTuner(device=torch.device("cpu"))
    q = NormKey(
        d_in=16, d_out=12, seq=10, dtype="torch.float32", device="cpu", bias=True, readers=3
    )
    kv = NormKey(d_in=16, d_out=12, seq=10, dtype="torch.float32", device="cpu", readers=3)
    tuner.costs = {
        q: {Candidate(0): 1.0, Candidate(4): 0.5},
        kv: {Candidate(0): 0.4, Candidate(4): 0.6},
    }
    tuner.table = {q: Choice(4), kv: Choice(0)}
    tuner._new, tuner._groups = [q, kv], {1: {q, kv}}
    tuner.end_pass()
    assert tuner.table == {q: Choice(4), kv: Choice(4)}  # 1.1 ms in all against 1.4


def test_a_real_timing_run_picks_a_candidate_and_caches_it(setup):
    base, x, y, C = setup
    model, gsm, opt, crit = _private(base, C, tune_norms=True, timing=True)
    tuner = gsm.norm_tuner
    tuner.blocks = (4,)
    _step(gsm, opt, crit, x[:B], y[:B])
    assert len(tuner.tuned) == len(tuner.table) == 5 and tuner.tuning_ms > 0
    for key, choice in tuner.table.items():
        cands = tuner.candidates(key, per_sample=True)
        assert Candidate(choice.block) in cands
        assert set(tuner.costs[key]) == set(cands) and all(
            ms > 0 for ms in tuner.costs[key].values()
        )
    first = dict(tuner.table)
    spent = tuner.tuning_ms
    _step(gsm, opt, crit, x[B:], y[B:])
    assert tuner.table == first and tuner.tuning_ms == spent and len(tuner.tuned) == 5
    assert "norm_tuning" not in gsm_timings(gsm)


def gsm_timings(gsm):
    return gsm.norm_tuner.timer.last_step


def test_tuning_time_is_its_own_phase_and_left_out_of_the_others():
    timer = StepTimer(enabled=True, log=False)
    import time

    with timer.phase("first_backward"):
        with timer.phase("norms"):
            with timer.phase("norm_tuning", excluded=True):
                time.sleep(0.05)
            time.sleep(0.01)
    got = timer.flush()
    assert got["norm_tuning"] >= 50
    assert 10 <= got["norms"] < 40 and got["first_backward"] < 45


def test_a_new_sequence_length_retunes_and_a_new_batch_size_does_not(setup):
    base, x, y, C = setup
    model, gsm, opt, crit = _private(base, C, tune_norms=True)
    tuner = gsm.norm_tuner
    tuner.blocks, tuner.cost_fn = (4,), _injected
    _step(gsm, opt, crit, x[:B], y[:B])
    assert len(tuner.tuned) == 5
    _step(gsm, opt, crit, x[B : B + 3], y[B : B + 3])  # another batch size: no tuning
    assert len(tuner.tuned) == 5
    g = torch.Generator().manual_seed(9)
    x12, y12 = torch.randn(B, 12, D, generator=g), torch.randint(0, CLASSES, (B, 12), generator=g)
    _step(gsm, opt, crit, x12, y12)
    assert len(tuner.tuned) == 10 and {k.seq for k in tuner.tuned[5:]} == {12}
    # A changed layer shape (another model's) is a new key as well.
    other = NormTuner(device=torch.device("cpu"), cost_fn=_injected, blocks=(4,))
    layer = torch.nn.Linear(16, 7)
    choice = other.choose(layer, torch.randn(2, 10, 16), torch.randn(2, 10, 7))
    assert choice == Choice(block=0) and len(other.tuned) == 1
    assert next(iter(other.table)).d_out == 7


@pytest.mark.parametrize("pattern", ["injected", "blocks", "per_sample", "timed"])
def test_parameters_after_two_steps_equal_tuning_off_and_the_loop(setup, pattern):
    base, x, y, C = setup
    model, gsm, opt, crit = _private(base, C, tune_norms=True)
    tuner = gsm.norm_tuner
    tuner.blocks = (3, 4)
    tuner.cost_fn = {
        "injected": _injected,
        "blocks": lambda k, c: 1.0 if c.block == 3 and not c.per_sample else 2.0,
        "per_sample": lambda k, c: 1.0 if c.per_sample else 2.0,
        "timed": None,
    }[pattern]
    for s in range(2):
        _step(gsm, opt, crit, x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    ours = _params(model)
    if pattern == "per_sample":
        assert gsm.per_sample_policy.taken == 6
    if pattern == "blocks":
        assert {c.block for c in tuner.table.values()} == {3}
    off_model, off, off_opt, off_crit = _private(base, C, tune_norms=False)
    assert off.norm_tuner is None
    for s in range(2):
        _step(off, off_opt, off_crit, x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    assert _diff(ours, _params(off_model)) <= 1e-6
    assert _diff(ours, _loop(base, x, y, C)) <= 1e-6
    assert _diff(ours, _params(base)) > 1e-3


def test_a_stored_plan_starts_the_next_run_tuned(setup, tmp_path):
    base, x, y, C = setup
    path = tmp_path / "plans.json"
    model, gsm, opt, crit = _private(base, C, tune_norms=True, tune_norms_cache=str(path))
    gsm.norm_tuner.blocks, gsm.norm_tuner.cost_fn = (4,), _injected
    _step(gsm, opt, crit, x[:B], y[:B])
    assert path.exists() and gsm.norm_tuner.name in path.read_text()
    again, gsm2, opt2, crit2 = _private(base, C, tune_norms=True, tune_norms_cache=str(path))
    gsm2.norm_tuner.cost_fn = lambda k, c: pytest.fail("a stored key was timed again")
    _step(gsm2, opt2, crit2, x[:B], y[:B])
    assert gsm2.norm_tuner.tuned == [] and gsm2.norm_tuner.table == gsm.norm_tuner.table
    assert gsm2.per_sample_policy.taken == 2


def test_auto_is_on_for_accelerators_and_off_on_cpu():
    assert tuning_wanted("auto", torch.device("cuda", 0))
    assert not tuning_wanted("auto", torch.device("cpu"))
    assert tuning_wanted(True, torch.device("cpu"))
    assert PrivacyEngine().options.tune_norms == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="tune_norms"):
            PrivacyEngine(tune_norms=bad)
    with pytest.raises(ValueError, match="tune_norms_cache"):
        PrivacyEngine(tune_norms_cache=3)
    assert PrivacyEngine(sync_optimization=False).options.effective.tune_norms is False


def test_candidates_follow_the_options():
    assert sensible_blocks(1024) == [64, 128, 256, 512]
    assert sensible_blocks(128) == [32, 64] and sensible_blocks(32) == []
    key = NormKey(d_in=8, d_out=8, seq=128, dtype="torch.float32", device="cpu")
    auto = NormTuner(device=torch.device("cpu"))
    assert auto.candidates(key, per_sample=True) == [
        Candidate(0),
        Candidate(32),
        Candidate(64),
        Candidate(per_sample=True),
    ]
    fixed = NormTuner(device=torch.device("cpu"), gram_block=16)  # an explicit block is kept
    assert fixed.candidates(key, per_sample=False) == [Candidate(16)]


def test_a_candidate_over_the_memory_budget_is_never_timed_nor_chosen(setup, caplog):
    """Full Grams are the fastest by the injected costs but over the budget (their working set,
    8 N T^2 bytes in fp32 for the two Grams, is about twice the 4-token blocks' here): skipped,
    logged, not timed."""
    layer = torch.nn.Linear(16, 12)
    a, g = torch.randn(2, 10, 16), torch.randn(2, 10, 12)
    full = LinearRoom.working_set(layer, a, g, Candidate(0), with_weight_grad=False)
    blocked = LinearRoom.working_set(layer, a, g, Candidate(4), with_weight_grad=False)
    assert full == 8 * 2 * 10 * 10 and blocked < full
    timed = []

    def cost(key, cand):
        timed.append(cand)
        return 1.0 if cand == Candidate(0) else 2.0

    free = NormTuner(device=torch.device("cpu"), cost_fn=cost, blocks=(4,))
    assert free.choose(layer, a, g) == Choice(block=0)  # control: no budget, full Grams win
    timed.clear()
    tuner = NormTuner(device=torch.device("cpu"), cost_fn=cost, blocks=(4,), memory_budget=blocked)
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        assert tuner.choose(layer, a, g) == Choice(block=4)
    assert timed == [Candidate(4)]
    assert tuner.skipped == {next(iter(tuner.table)): {Candidate(0): full}}
    lines = [r.getMessage() for r in caplog.records if "not timed" in r.getMessage()]
    assert len(lines) == 1 and f"full Grams ({size_text(full)})" in lines[0], lines
    assert f"tuning budget of {size_text(blocked)}" in lines[0]
    timed.clear()  # nothing fits: the least working set is taken untimed
    tight = NormTuner(device=torch.device("cpu"), cost_fn=cost, blocks=(4,), memory_budget=1)
    assert tight.choose(layer, a, g) == Choice(block=4) and timed == []
    base, x, y, C = setup
    _, gsm, _, _ = _private(base, C, tune_norms=True, tune_norms_memory_budget=blocked)
    assert gsm.norm_tuner.memory_budget == blocked  # the option reaches the engine's tuner


@pytest.mark.distributed
def test_two_ranks_agree_on_rank0_plan_with_different_batch_sizes():
    """FSDP2, local batches of 3 and 5: rank 0 alone tunes (its injected costs), rank 1 takes
    its table by one broadcast; a later, untuned length takes the nearest tuned one's plan on
    both ranks (no collective: no hang); parameters equal tuning off."""
    res = run_ranks(workers_tuner.agree_on_rank0_plan, 2, timeout=300)
    r0, r1 = res
    assert r0["table"] == r1["table"] and len(r0["table"]) == 5
    assert r0["tuned"] == 5 and r1["tuned"] == 0
    assert r0["agreed"] and r1["agreed"]
    assert (
        "Linear 12->20 (weight) T=10 float32 cpu, input shared by 2",
        "per-sample gradients",
    ) in r0["table"]
    assert r0["derived"] == r1["derived"] and len(r0["derived"]) == 5  # T = 12, from T = 10
    assert r0["taken"] == [2, 2, 2] and r1["taken"] == [0, 2, 2]  # rank 1: static rules at first
    assert r0["on_vs_off"] <= 1e-6 and r1["on_vs_off"] <= 1e-6
    assert r0["moved"] > 1e-3


def test_a_poisson_run_times_each_shape_once(setup):
    """Under Poisson sampling the batch size changes every step; the key leaves it out, so each
    layer shape (and length) is timed once, in the first step, whatever the later batches."""
    from torch.utils.data import DataLoader, TensorDataset

    base, x, y, C = setup
    model = copy.deepcopy(base)
    engine = PrivacyEngine(tune_norms=True)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=torch.nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=C,
        poisson_sampling=True,
        grad_sample_mode="ghost",
    )
    tuner = gsm.norm_tuner
    timed: dict = {}

    def counting(key, cand):
        timed[(key, cand)] = timed.get((key, cand), 0) + 1
        return _injected(key, cand)

    tuner.blocks, tuner.cost_fn = (4,), counting
    sizes = []
    for _ in range(3):  # epochs of the Poisson loader
        for xs, ys in loader:
            sizes.append(xs.shape[0])
            if xs.shape[0]:
                _step(gsm, opt, crit, xs, ys)
    assert len(set(sizes)) >= 2  # the batch size did vary
    assert len(tuner.tuned) == len(set(tuner.tuned)) == 5  # one entry per layer shape
    assert timed and max(timed.values()) == 1  # every candidate of every key timed once
