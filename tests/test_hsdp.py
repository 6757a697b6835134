"""HSDP on FSDP2 (2 replica groups x 2 shards, 4 gloo ranks) is exact, calibrated and in step.

Both builds of the layout (``ShardingConfig(strategy="hybrid_full", replicate_degree=2)`` through
``shard_model``, and a hand-made 2-D ``fully_shard``) run two private steps with Poisson sampling
on, in the default one-backward step and in the two-pass sync-skipping step, with noise 0 and
with noise. Reference: the clip-each-sample loop over the same global draws (``dp_seed`` makes
them reproducible, see :mod:`tests.workers_hsdp`), with plain SGD and the sum of clipped
gradients divided by the expected batch, as Opacus does under Poisson sampling.

One spawn of the four ranks serves every test here (a module fixture); the tests only judge.
"""

from __future__ import annotations

import pytest
import torch

from opacus_fsdp_sync.testing import per_sample_clipped_grads, run_ranks
from tests import workers_hsdp as wh
from tests.workers_layouts import _base, _named, _sample_loss

# 16-20 s on two idle cores, 34 s when they were shared with other jobs (one spawn of 4 ranks)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 4
LAYOUTS = pytest.mark.parametrize("layout", wh.LAYOUTS)
MODES = pytest.mark.parametrize("mode", list(wh.MODES))


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """Every rank's results of :func:`tests.workers_hsdp.hsdp`."""
    return run_ranks(wh.hsdp, WORLD, timeout=300)


@pytest.fixture(scope="module")
def loop(results) -> dict:
    """The clip-each-sample loop over rank 0's draws: parameters after each step, norms."""
    run = results[0][wh.LAYOUTS[0], "one_backward", 0.0]
    x, y = wh.dataset().tensors
    model = _base()
    before = _named(model)
    after, norms = [], []
    for sel in run["selections"]:
        if sel:
            grads, n = per_sample_clipped_grads(model, _sample_loss, x[sel], y[sel], wh.C, "sum")
            norms.append(n)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.sub_(wh.LR * grads[name] / run["expected_batch"])
        after.append(_named(model))
    update = max((before[n] - after[-1][n]).abs().max().item() for n in before)
    return {
        "selections": run["selections"],
        "after": after,
        "norms": torch.cat(norms),
        "update": update,
    }


def _runs(results, layout):
    """Every private run of ``layout`` on every rank."""
    for res in results:
        for key, run in res.items():
            if key[0] == layout and len(key) == 3:
                yield run


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_poisson_draws_are_shared_and_leave_a_rank_empty(results, loop):
    """Every run drew the same global batches, split over all 4 ranks; some rank got none."""
    sizes = [len(s) for s in loop["selections"]]
    assert all(sizes), sizes  # every step has examples (the loop has something to compare)
    empty_rank = False
    for layout in wh.LAYOUTS:
        runs = list(_runs(results, layout))
        assert len(runs) == WORLD * 4
        for run in runs:
            assert run["selections"] == loop["selections"]
            assert run["world_share"] == WORLD  # the dp degree is replicate x shard
        for t, size in enumerate(sizes):
            for mode in wh.MODES:
                for noise in (0.0, wh.SIGMA):
                    local = [res[layout, mode, noise]["sizes"][t] for res in results]
                    assert sum(local) == size and max(local) - min(local) <= 1, local
                    empty_rank |= 0 in local
    assert empty_rank, sizes


@LAYOUTS
def test_the_layout_is_hsdp_on_a_2x2_mesh(results, layout):
    names = {"shard_model": ("replicate", "shard"), "manual_2d": ("dp_replicate", "dp_shard")}
    for rank, res in enumerate(results):
        dims, coord, placements = res[layout, "one_backward", 0.0]["mesh"]
        assert dims == names[layout] and tuple(coord) == (rank // 2, rank % 2), (dims, coord)
        assert placements == ["Replicate()", "Shard(dim=0)"], placements


@LAYOUTS
@MODES
def test_noise_free_steps_equal_the_clip_each_sample_loop(results, loop, layout, mode):
    norms = loop["norms"]
    assert (norms > wh.C).any() and (norms <= wh.C).any(), norms  # clipping active, not always
    worst = 0.0
    for res in results:
        run = res[layout, mode, 0.0]
        assert run["one_backward"] == [wh.MODES[mode]] * wh.STEPS  # the step we meant to test
        for t in range(wh.STEPS):
            worst = max(worst, _diff(run["full"][t], loop["after"][t]))
    assert worst <= 1e-6 * loop["update"], (layout, mode, worst, loop["update"])


@LAYOUTS
@MODES
def test_noise_std_is_sigma_c_over_the_expected_batch(results, layout, mode):
    """Noise: the first step's update with noise minus the update without (same draw)."""
    expected = wh.SIGMA * wh.C / wh.BATCH
    clean, noisy = results[0][layout, mode, 0.0], results[0][layout, mode, wh.SIGMA]
    assert clean["expected_batch"] == pytest.approx(wh.BATCH)
    z = torch.cat(
        [
            (clean["full"][0][n] - noisy["full"][0][n]).flatten() / wh.LR
            for n in sorted(clean["full"][0])
        ]
    )
    assert z.numel() >= 20_000
    ratio = z.std().item() / expected
    assert abs(ratio - 1.0) < 0.02, (layout, mode, ratio)
    assert abs(z.mean().item()) < 0.02 * expected, (layout, mode, z.mean().item())
    # the two shards draw independent noise (replicas draw the same: the next test)
    a = clean["local"][0] - noisy["local"][0]
    b = results[1][layout, mode, 0.0]["local"][0] - results[1][layout, mode, wh.SIGMA]["local"][0]
    k = min(a.numel(), b.numel())
    assert k > 10_000 and abs(torch.corrcoef(torch.stack([a[:k], b[:k]]))[0, 1].item()) < 0.05


@LAYOUTS
@MODES
@pytest.mark.parametrize("noise", [0.0, wh.SIGMA])
def test_replica_groups_end_bit_identical(results, layout, mode, noise):
    """Ranks (0, 2) and (1, 3) hold the same shard; (0, 1) and (2, 3) are the replica groups."""
    runs = [res[layout, mode, noise] for res in results]
    for t in range(wh.STEPS):
        for shard in (0, 1):
            assert torch.equal(runs[shard]["local"][t], runs[shard + 2]["local"][t]), (shard, t)
        assert not torch.equal(runs[0]["local"][t], runs[1]["local"][t])  # really sharded
        group0, group1 = runs[0]["full"][t], runs[2]["full"][t]
        assert group0.keys() == group1.keys()
        assert all(torch.equal(group0[n], group1[n]) for n in group0), (t, layout, mode, noise)


@LAYOUTS
@MODES
def test_collectives_equal_the_non_private_step(results, layout, mode):
    for rank, res in enumerate(results):
        floor = res[layout, "non_private"]
        # HSDP's signature: all-gather and reduce-scatter in a group, all-reduce across groups
        assert all(
            step.get(k, 0) > 0
            for step in floor
            for k in ("all_gather", "reduce_scatter", "all_reduce")
        ), floor
        for noise in (0.0, wh.SIGMA):
            counts = res[layout, mode, noise]["counts"]
            assert counts == floor, (rank, noise, counts, floor)
