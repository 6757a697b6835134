"""Distributed Poisson sampling: no desync, true statistics, exact steps, resumable DP state.

Poisson sampling is on throughout (the point of these tests).
"""

import os

import pytest
import torch

from opacus_fsdp_sync.sampling import SharedPoissonSampler, physical_batches
from opacus_fsdp_sync.testing import per_sample_clipped_grads, run_ranks
from tests import workers_poisson as wp
from tests.workers_layouts import _base, _named, _sample_loss

SEEDS = list(range(20))


def test_physical_batch_count_is_the_largest_share_over_the_limit():
    assert physical_batches(0, 2, 3) == 1  # an empty draw is still one (empty) batch
    assert physical_batches(7, 2, 3) == 2  # shares 4 and 3
    assert physical_batches(7, 3, 3) == 1  # shares 3, 2, 2
    assert physical_batches(10, 3, 3) == 2  # shares 4, 3, 3


def test_shares_differ_by_at_most_one_and_cover_the_draw():
    shards = [
        SharedPoissonSampler(num_samples=50, sample_rate=0.3, steps=4, seed=5, rank=r, world_size=3)
        for r in range(3)
    ]
    for t in range(4):
        selected = shards[0].global_draw(t)
        parts = [s.local_share(s.global_draw(t)) for s in shards]
        assert sorted(sum(parts, [])) == selected.tolist()
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1


def test_draw_statistics_match_binomial_and_steps_are_independent():
    n, q, steps = 200, 0.05, 3000
    s = SharedPoissonSampler(num_samples=n, sample_rate=q, steps=steps, seed=123)
    masks = torch.zeros(steps, n)
    for t in range(steps):
        masks[t, s.global_draw(t)] = 1
    counts = masks.sum(1)
    mean, var = n * q, n * q * (1 - q)
    # 5 standard errors: mean SE sqrt(var / steps), variance SE var sqrt(2 / steps)
    assert abs(counts.mean().item() - mean) < 5 * (var / steps) ** 0.5
    assert abs(counts.var().item() - var) < 5 * var * (2 / steps) ** 0.5
    rates = masks.mean(0)  # every example's inclusion rate
    assert (rates - q).abs().max().item() < 5 * (q * (1 - q) / steps) ** 0.5
    lag = torch.corrcoef(torch.stack([counts[:-1], counts[1:]]))[0, 1].item()
    assert abs(lag) < 5 / steps**0.5  # consecutive steps' sizes uncorrelated
    overlap = (masks[:-1] * masks[1:]).sum(1).mean().item()  # independent: n q^2 in common
    assert abs(overlap - n * q * q) < 5 * (n * q * q / steps) ** 0.5


def test_each_step_keys_its_draw_with_every_bit_of_the_seed():
    """Two steps whose 64-bit step seeds agree in their low 32 bits (all a CPU torch generator
    keeps) draw different batches: the draw is keyed by the whole seed and the step. Seeded per
    step with a torch generator, they drew the same batch (a repeated draw breaks the
    accounting's independent sampling)."""
    from opacus_fsdp_sync.randomness import splitmix64

    seed = 0x5EED_0F_C0FFEE  # a fixed seed, so that the colliding pair below exists (the opt-in)
    seen, pair = {}, None
    for t in range(1 << 18):
        low = splitmix64(seed, t) & 0xFFFFFFFF
        if low in seen:
            pair = (seen[low], t)
            break
        seen[low] = t
    assert pair is not None
    s = SharedPoissonSampler(num_samples=4000, sample_rate=0.05, steps=1, seed=seed)
    a, b = (s.global_draw(t).tolist() for t in pair)
    assert a != b
    # and seeds that differ only above bit 32 draw differently too
    other = SharedPoissonSampler(num_samples=4000, sample_rate=0.05, steps=1, seed=seed + 2**32)
    assert other.global_draw(pair[0]).tolist() != a


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", ["tiny", "bmm"])
@pytest.mark.parametrize("layout", ["fsdp2_root", "fsdp1_root", "ddp_root"])
def test_no_desync_over_many_draws(layout, config, world):
    results = run_ranks(wp.no_desync, world, layout, config, SEEDS, timeout=600)
    empty_local = empty_global = 0
    for seed in SEEDS:
        per_rank = [r[seed] for r in results]
        assert len({(r["logical"], r["physical"]) for r in per_rank}) == 1, (seed, per_rank)
        r0 = per_rank[0]
        assert r0["logical"] == r0["steps"] == r0["completed"]  # every draw a step
        empty_local += sum(sum(1 for s in r["sizes"] if s == 0) for r in per_rank)
        empty_global += sum(1 for g in r0["globals"] if g == 0)
    assert empty_local > 0 and empty_global > 0


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["tiny", "bmm"])
def test_the_harness_catches_opacus_own_sampler(config):
    """Opacus's distributed sampler and memory manager give ranks different step counts."""
    results = run_ranks(wp.opacus_counts, 2, config, SEEDS, timeout=300)
    assert any(results[0][s] != results[1][s] for s in SEEDS)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2_root", "fsdp1_root", "ddp_root"])
def test_poisson_steps_equal_the_loop_over_the_same_selection(layout):
    steps = 20
    results = run_ranks(wp.exact_steps, 2, layout, steps, timeout=300)
    r0 = results[0]
    assert all(r["selections"] == r0["selections"] for r in results)
    sizes = [len(s) for s in r0["selections"]]
    assert 0 in sizes  # an empty global batch, still a step
    assert any(0 in (r["local_sizes"][t] for r in results) and sizes[t] > 0 for t in range(steps))
    data = wp._dataset(wp.CONFIGS["tiny"]["n"])
    ref = _base()
    clipped_any = False
    for sel in r0["selections"]:
        if not sel:
            continue
        x, y = data.tensors[0][sel], data.tensors[1][sel]
        grads, norms = per_sample_clipped_grads(ref, _sample_loss, x, y, 1.0, "sum")
        clipped_any |= bool((norms > 1.0).any())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.sub_(0.5 * grads[n] / r0["expected_batch"])
    assert clipped_any
    want = _named(ref)
    for r in results:
        diff = max((r["params"][n] - want[n]).abs().max().item() for n in want)
        assert diff <= 1e-6, (layout, diff)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2_root", "ddp_root"])
def test_resume_continues_bit_for_bit(layout, tmp_path):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(wp.resume, 2, layout, path, "straight", 3, 6, timeout=300)
    run_ranks(wp.resume, 2, layout, path, "first", 3, 6, timeout=300)
    assert os.path.exists(os.path.join(path, "dp_state_rank1.pt"))
    resumed = run_ranks(wp.resume, 2, layout, path, "second", 3, 6, timeout=300)
    control = run_ranks(wp.resume, 2, layout, path, "no_dp_state", 3, 6, timeout=300)
    for a, b, c in zip(straight, resumed, control):
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert a["epsilon"] == b["epsilon"] and a["completed"] == b["completed"] == 6
        # without the DP state: other noise and draws, epsilon of 3 steps instead of 6
        assert not all(torch.equal(a["params"][n], c["params"][n]) for n in a["params"])
        assert c["epsilon"] < a["epsilon"]


@pytest.mark.distributed
def test_checkpoint_of_another_configuration_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(wp.resume, 2, "fsdp2_root", path, "first", 1, 2, timeout=300)
    res = run_ranks(wp.bad_checkpoints, 2, path, timeout=300)[0]
    assert "noise_multiplier=1.0" in res["noise"] and "0.5" in res["noise"], res
    assert "CheckpointMismatchError" in res["batch"], res
    assert res["same_fresh_False"][0] is None and res["same_fresh_False"][1], res
    three = run_ranks(wp.bad_checkpoints, 3, path, timeout=300)[0]
    message, _ = three["same_fresh_False"]
    assert "world_size: saved 2, now 3" in message and "fresh_noise=True" in message, message
    message, history = three["same_fresh_True"]
    assert message is None and history == res["same_fresh_False"][1]  # the accountant goes on


def test_iterable_dataset_is_refused_with_what_to_do():
    from torch.utils.data import DataLoader, IterableDataset

    from opacus_fsdp_sync.sampling import SharedPoissonDataLoader

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ValueError, match="map-style Dataset"):
        SharedPoissonDataLoader.from_data_loader(DataLoader(Stream(), batch_size=1), secure=False)


@pytest.mark.distributed
def test_empty_ranks_of_a_llama_contribute_exactly_zero():
    """Hugging Face's Llama cannot run a zero-size batch: empty ranks run a zero-weighted
    stand-in, and the result still equals the loop over the global selections."""
    from opacus_fsdp_sync.models import LlamaSpec, build_llama
    from tests.workers_tied import llama_sample_loss

    steps = 6
    results = run_ranks(wp.llama_empty_ranks, 2, steps, timeout=300)
    r0 = results[0]
    sizes = [len(s) for s in r0["selections"]]
    assert 0 in sizes and 1 in sizes, sizes  # an empty draw, and a rank left without examples
    assert all(r["selections"] == r0["selections"] for r in results)
    assert any(0 in (r["sizes"][t] for r in results) and sizes[t] > 0 for t in range(steps))
    torch.manual_seed(0)
    ref = build_llama(LlamaSpec(preset="tiny"))
    clipped = False
    for sel in r0["selections"]:
        if not sel:
            continue
        x = r0["ids"][sel]
        grads, norms = per_sample_clipped_grads(ref, llama_sample_loss, x, x, 0.05, "sum")
        clipped |= bool((norms > 0.05).any())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.sub_(0.5 * grads[n] / r0["expected_batch"])
    assert clipped
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for r in results:
        diff = max((r["params"][n] - want[n]).abs().max().item() for n in want)
        assert diff <= 1e-6, diff
