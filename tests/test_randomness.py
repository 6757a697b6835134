"""DP randomness is a secret: seeds from OS entropy, no draw used twice, no noise replayed.

Poisson sampling is on throughout. Tests that compare runs draw for draw opt in with
``PrivacyEngine(dp_seed=...)``, the one way to make DP randomness reproducible.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync import _generator_internals as generator_internals
from opacus_fsdp_sync._generator_internals import seeded_generator
from opacus_fsdp_sync.distributed import TorchInternalsError
from opacus_fsdp_sync.randomness import (
    _MIX,
    DPRandomness,
    _purpose_code,
    shard_generators,
    splitmix64,
)
from opacus_fsdp_sync.testing import run_ranks
from tests import workers_randomness as wr
from tests.workers_layouts import _base


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()


def test_seeds_ignore_torch_manual_seed_unless_dp_seed_is_given(caplog):
    torch.manual_seed(0)
    a = DPRandomness().local_seed("sampler")
    torch.manual_seed(0)
    b = DPRandomness().local_seed("sampler")
    assert a != b  # OS entropy: 63 random bits each
    with caplog.at_level(logging.WARNING):
        seeded = DPRandomness(11)
    assert "privacy rests on the seed staying secret" in caplog.text
    again = DPRandomness(11)
    firsts = [seeded.local_seed("sampler"), seeded.local_seed("noise")]
    assert firsts == [again.local_seed("sampler"), again.local_seed("noise")]
    assert len({*firsts, seeded.local_seed("sampler")}) == 3  # purposes and repeats differ
    assert splitmix64(11, 0) != splitmix64(11, 1)


def test_cpu_dp_generators_depend_on_every_bit_of_their_seed():
    # torch's CPU generator keeps a seed's low 32 bits, so manual_seed(s) and
    # manual_seed(s + 2**32) draw the same noise; ours must not.
    low = 12345
    high = low + 2**32
    torch_a, torch_b = (torch.Generator().manual_seed(s) for s in (low, high))
    assert torch.equal(torch.randn(8, generator=torch_a), torch.randn(8, generator=torch_b))
    ours_a, ours_b, again = (seeded_generator(torch.device("cpu"), s) for s in (low, high, low))
    first = torch.randn(8, generator=ours_a)
    assert not torch.equal(first, torch.randn(8, generator=ours_b))
    assert torch.equal(first, torch.randn(8, generator=again))  # still a function of the seed
    # The engine's noise, sampler and shard generators take that path: two dp_seeds whose
    # derived noise seeds agree in their low 32 bits would otherwise share a stream.
    src = DPRandomness(3)
    seed = splitmix64(3, _purpose_code("noise", 0))
    noise = src.generator("noise", torch.device("cpu"), distributed=False)
    want = seeded_generator(torch.device("cpu"), seed)
    assert torch.equal(torch.randn(8, generator=noise), torch.randn(8, generator=want))
    cpu = torch.device("cpu")
    base = int(torch.randint(0, 2**62, (1,), generator=seeded_generator(cpu, 9)))
    shard_seed = (base ^ ((hash((0,)) % 2**61 + 1) * _MIX)) % 2**63
    (shard,) = shard_generators(seeded_generator(cpu, 9), cpu, [(0,)])
    assert torch.equal(shard.get_state(), seeded_generator(cpu, shard_seed).get_state())


def test_a_cpu_generator_state_of_another_layout_fails_loudly(monkeypatch):
    monkeypatch.setattr(generator_internals, "STATE_BYTES", 5048)
    generator_internals.check_layout.cache_clear()
    try:
        with pytest.raises(TorchInternalsError, match="state is 5056 bytes .* secure_mode=True"):
            generator_internals.cpu_generator(1)
    finally:
        generator_internals.check_layout.cache_clear()
    # A layout that sizes right but puts the words elsewhere draws other numbers: refused.
    monkeypatch.undo()
    monkeypatch.setattr(generator_internals, "_WORDS", 32)
    try:
        with pytest.raises(TorchInternalsError, match="does not draw what that state draws"):
            generator_internals.check_layout()
    finally:
        generator_internals.check_layout.cache_clear()


def test_dp_seed_is_refused_with_secure_mode_and_must_be_an_int():
    with pytest.raises(ValueError, match="secure_mode=True .* dp_seed"):
        PrivacyEngine(secure_mode=True, dp_seed=1)
    with pytest.raises(ValueError, match="dp_seed must be None or a non-negative int"):
        PrivacyEngine(dp_seed="1")


def _one_device(n: int = 40, batch: int = 4, num_workers: int = 0, **loader):
    """A one-device model made private with the shared sampler; x[:, 0] is the example index."""
    x = torch.randn(n, 32)
    x[:, 0] = torch.arange(n, dtype=torch.float)
    data = TensorDataset(x, torch.randint(0, 4, (n,)))
    model = _base()
    engine = PrivacyEngine()
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=batch, num_workers=num_workers, **loader),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
    )
    return engine, gsm, opt, crit, loader


def _steps_counted(engine) -> int:
    return sum(entry[-1] for entry in engine.accountant.history)


def test_a_skipped_step_never_repeats_a_draw_and_every_draw_is_counted():
    engine, gsm, opt, crit, loader = _one_device()
    sampler = engine.sampler
    seen = []
    for epoch in range(2):
        for i, (xb, yb) in enumerate(loader):
            seen.append(sorted(xb[:, 0].long().tolist()))
            crit(gsm(xb), yb).backward()
            if epoch == 0 and i in (2, 5):  # skipped: e.g. recovered from an out-of-memory error
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        if epoch == 0:  # an abandoned iterator: its next draw was never handed out
            it = iter(loader)
            next(it)
            seen.append(None)
    steps = len(loader)
    expected = [sampler.global_draw(t).tolist() for t in range(2 * steps + 1)]
    taken = [s for s in seen if s is not None]
    # draws 0..steps-1, then the abandoned iterator's draw, then the next epoch from there on
    assert taken == expected[:steps] + expected[steps + 1 : steps + 1 + len(taken) - steps]
    assert sampler.handed_out == len(taken) + 1
    # every draw handed out is counted, stepped on or not
    assert _steps_counted(engine) == sampler.handed_out
    assert engine.optimizer_steps == len(taken) - 2


def test_a_second_step_on_one_draw_counts_again_and_warns(caplog):
    engine, gsm, opt, crit, loader = _one_device()
    xb, yb = next(iter(loader))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            crit(gsm(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    assert "second optimizer step on the same Poisson draw" in caplog.text
    assert _steps_counted(engine) == 2 and engine.sampler.handed_out == 1


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent_workers"])
@pytest.mark.parametrize("physical", [None, 2])
def test_loader_workers_fetching_ahead_count_each_draw_once(caplog, physical, persistent):
    """Worker processes fetch draws before the loop takes them: every step (one per draw) is
    still counted once and none is taken for a second step on its draw (with them, the last
    steps of each epoch were counted twice, with a warning each), whole draws or in physical
    batches; a real second step on a draw still counts again."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    engine, gsm, opt, crit, loader = _one_device(
        n=48, batch=4, num_workers=2, persistent_workers=persistent
    )
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            if physical is None:
                context, batches = contextlib.nullcontext(), loader
            else:
                context = BatchMemoryManager(
                    data_loader=loader, max_physical_batch_size=physical, optimizer=opt
                )
                batches = context.__enter__()
            for xb, yb in batches:
                crit(gsm(xb), yb).backward()
                opt.step()
                opt.zero_grad()
            context.__exit__(None, None, None)
    assert "second optimizer step" not in caplog.text
    assert engine.optimizer_steps == engine.sampler.handed_out == 2 * len(loader)
    assert _steps_counted(engine) == engine.sampler.handed_out
    crit(gsm(xb), yb).backward()  # the last draw again
    opt.step()
    assert "second optimizer step on the same Poisson draw" in caplog.text
    assert _steps_counted(engine) == engine.sampler.handed_out + 1


@pytest.mark.distributed
@pytest.mark.parametrize("layout,world", [("fsdp2_root", 2), ("fsdp1_root", 2), ("ddp_root", 2),
                                          ("single", 1)])  # fmt: skip
def test_same_user_seed_gives_other_draws_and_noise_unless_dp_seed(layout, world):
    res = run_ranks(wr.same_user_seed, world, layout, timeout=300)[0]
    a, b = res["entropy_a"], res["entropy_b"]
    assert a["draw"] != b["draw"]
    assert a["update"].numel() > 10_000
    assert abs(_corr(a["update"], b["update"])) < 0.1  # independent noise
    s, t = res["seed_a"], res["seed_b"]  # the opt-in reproduces both exactly
    assert s["draw"] == t["draw"] and torch.equal(s["update"], t["update"])


@pytest.mark.distributed
def test_fresh_noise_on_another_world_size_replays_no_noise(tmp_path):
    path = str(tmp_path / "ckpt")
    first = run_ranks(wr.fresh_noise, 2, "first", path, 3, timeout=300)[0]
    second = run_ranks(wr.fresh_noise, 1, "second", path, 1, timeout=300)[0]
    (resumed,) = second["updates"]
    assert resumed.numel() > 10_000
    for original in first["updates"]:
        assert abs(_corr(resumed, original)) < 0.1
    assert sum(e[-1] for e in second["history"]) == 4  # the accountant went on from 3


@pytest.mark.distributed
@pytest.mark.parametrize(
    "saved,loaded,named",
    [("ddp_root", "fsdp2_root", "api: saved 'ddp', now 'fsdp2'"),
     ("fsdp2_root", "fsdp2_hsdp", "trainable parameter 0")],
)  # fmt: skip
def test_a_checkpoint_of_another_layout_is_refused(tmp_path, saved, loaded, named):
    path = str(tmp_path / "ckpt")
    run_ranks(wr.cross_layout, 2, "save", saved, path, timeout=300)
    same = run_ranks(wr.cross_layout, 2, "load", saved, path, timeout=300)[0]
    assert same["error"] is None  # the saved layout resumes
    other = run_ranks(wr.cross_layout, 2, "load", loaded, path, timeout=300)[0]
    assert other["error"] is not None and "CheckpointMismatchError" in other["error"]
    assert named in other["error"] and "fresh_noise=True" in other["error"], other["error"]


@pytest.mark.distributed
def test_a_one_device_model_on_one_rank_of_a_group_issues_no_collective():
    res = run_ranks(wr.one_device_on_rank0, 2, timeout=120)[0]
    assert res == {"world": 1, "sizes_match": True, "steps": 2}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_draws_its_own_poisson_mask_in_every_mode(world):
    """Each rank's share of a Poisson draw is independent of the others' (DDP, ``hooks``,
    ``ew`` and ``ghost``, with and without ``dp_seed``, and with one DataLoader ``generator=``
    seeded alike on every rank).

    Opacus's distributed sampler gives rank r the records ``perm[r::world]`` and draws a mask
    over them from the rank's generator; one stream shared by the ranks includes the records at
    equal positions together (``perm[k * world + r]`` for every r), and the global batch size
    then varies ``world`` times too much. Both are checked on the union of the ranks' shares,
    for every mode alike: each fixed pair of records is drawn together with probability q^2,
    and the global batch size is Binomial(N, q).
    """
    n, batch, draws = 400, 40, 300
    q = batch / n
    ranks = run_ranks(wr.rank_masks, world, n, batch, draws, timeout=300)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))  # Opacus's split
    groups = perm[: n - n % world].view(-1, world)  # the records at one position on each rank
    for key in ranks[0]:
        picked = torch.zeros(draws, n, dtype=torch.bool)
        for res in ranks:
            for t, share in enumerate(res[key]):
                picked[t, share] = True
        sizes = picked.sum(1).double()
        expected = draws * len(groups) * q * q  # 600 on 2 ranks; a shared stream gives 10x
        for r in range(world - 1):  # ranks r and r + 1
            together = (picked[:, groups[:, r]] & picked[:, groups[:, r + 1]]).sum().item()
            assert together < 1.5 * expected, (key, r, together, expected)
        ratio = sizes.var().item() / (n * q * (1 - q))  # 1 for Poisson, `world` when shared
        assert 0.7 < ratio < 1.35, (key, ratio)
        assert abs(sizes.mean().item() - n * q) < 4 * (n * q * (1 - q) / draws) ** 0.5, key


@pytest.mark.distributed
@pytest.mark.parametrize("layout,world", [("single", 1), ("ddp_root", 2), ("fsdp2_root", 2)])
def test_a_fresh_noise_resume_counts_every_released_step_and_draws_new_batches(
    tmp_path, layout, world
):
    """Run A saves at step 2 and takes steps 3-4 (their outputs may have been seen); run B
    resumes the checkpoint with ``fresh_noise=True``. B must not draw A's batches 3-4 again,
    and its accountant must count A's steps 3-4 as well as its own: 6 steps, not 4.
    How far A went comes from the draw ledger beside the checkpoint; without it the resume is
    refused unless the user states the count."""
    from opacus.accountants import PRVAccountant

    path = str(tmp_path / "ckpt")
    a = run_ranks(wr.released_resume, world, layout, "a", path, timeout=300)[0]
    (ledger,) = tmp_path.glob("dp_draws_*.json")  # started by the checkpoint, beside it
    b = run_ranks(wr.released_resume, world, layout, "b", path, timeout=300)[0]
    assert [i for i, _ in a["taken"]] == [0, 1, 2, 3]
    assert [i for i, _ in b["taken"]] == [4, 5]  # new draws, not A's 2 and 3 again
    released = {tuple(d) for _, d in a["taken"]}
    assert all(tuple(d) not in released for _, d in b["taken"])
    assert b["steps"] == 6
    reference = PRVAccountant()
    for _ in range(6):
        reference.step(noise_multiplier=1.0, sample_rate=wr.BATCH / wr.N)
    assert b["epsilon"] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)

    ledger.unlink()  # where nothing says how far A went, fresh_noise is refused...
    refused = run_ranks(wr.released_resume, world, layout, "b", path, timeout=300)[0]
    assert "CheckpointMismatchError" in refused["error"]
    assert "steps_after_checkpoint=K" in refused["error"], refused["error"]
    stated = run_ranks(  # ...unless the user states it
        wr.released_resume, world, layout, "b", path, 2, timeout=300
    )[0]
    assert [i for i, _ in stated["taken"]] == [4, 5] and stated["steps"] == 6


def test_the_draw_ledger_writes_on_after_its_folder_was_removed(tmp_path):
    """A ledger whose folder went (a checkpoint folder rotated away) is written there again,
    never a crash in the middle of a draw."""
    import shutil

    from opacus_fsdp_sync.sampling.ledger import DrawLedger, LedgerPosition, read_ledger

    folder = tmp_path / "gone"
    folder.mkdir()
    ledger = DrawLedger(str(folder / "dp_draws_x.json"), write=True)
    ledger.record(LedgerPosition(handed_out=1, history=[[1.0, 0.1, 1]]))
    shutil.rmtree(folder)
    ledger.record(LedgerPosition(handed_out=2, history=[[1.0, 0.1, 2]]))
    assert read_ledger(str(folder / "dp_draws_x.json")).steps == 2


def test_fixed_batches_warn_that_the_epsilon_does_not_hold(caplog):
    """``poisson_sampling=False`` (a test of something other than sampling): the accountant
    still reports an epsilon, so the log says at WARNING, shown by default, that it does not
    hold."""
    from tests.private import make_private  # poisson_sampling=False

    data = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    with caplog.at_level(logging.WARNING):
        make_private(PrivacyEngine(), _base(), data, 4, 1.0, "ghost", noise=1.0)
    warned = [r for r in caplog.records if "does not hold" in r.getMessage()]
    assert warned and all(r.levelno == logging.WARNING for r in warned)


def test_a_checkpoint_loaded_while_workers_fetch_ahead_counts_on_from_its_position():
    """Loading a sampler's state resets what the loop was given; a live iterator counts on
    from the loaded position (it raised a TypeError on the reset count)."""
    from opacus_fsdp_sync.sampling import SharedPoissonSampler
    from opacus_fsdp_sync.sampling.delivery import count_delivered

    sampler = SharedPoissonSampler(num_samples=20, sample_rate=0.2, steps=5, seed=3)
    batches = count_delivered(lambda: iter(sampler), sampler, lambda: True)
    next(batches)
    assert sampler.delivered == 1
    sampler.load_state_dict(sampler.state_dict() | {"handed_out": 3})
    assert sampler.delivered is None
    next(batches)
    assert sampler.delivered == sampler.handed_out == 4


def test_opacus_loader_resumes_its_stream_rather_than_replaying_it(tmp_path):
    """Non-ghost modes draw from Opacus's Poisson loader, whose generator was not in the
    checkpoint: with ``dp_seed`` (the opt-in that makes draws reproducible, used here to
    compare runs) a resumed run drew the saved run's first batches again, counted as new steps.
    It now goes on with the draws an uninterrupted run makes."""
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    x = torch.arange(64, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
    data = TensorDataset(x, torch.zeros(64, dtype=torch.long))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2))
        engine = PrivacyEngine(dp_seed=1234)
        made = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="hooks",
        )
        return engine, made

    def run(made, steps):
        model, opt, loader = made[0], made[1], made[-1]
        drawn = []
        for xb, yb in loader:
            drawn.append(sorted(int(v) for v in xb[:, 0]))
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            if len(drawn) == steps:
                return drawn

    # An uninterrupted run, its loop also broken after 3 steps (every new iterator takes a
    # base seed for workers from the loader's generator, Opacus's sampler's too)
    made = build()[1]
    whole = run(made, 3) + run(made, 3)
    engine, made = build()
    first = run(made, 3)
    save_checkpoint(str(tmp_path / "ck"), made[0], made[1], engine=engine)
    engine, made = build()
    load_checkpoint(str(tmp_path / "ck"), made[0], made[1], engine=engine)
    assert first == whole[:3]
    assert run(made, 3) == whole[3:]
    assert sum(entry[-1] for entry in engine.accountant.history) == 6
    # fresh_noise draws the stream anew from OS entropy: two fresh resumes of one checkpoint
    # (dp_seed and all) draw other batches than each other and than the saved run went on with
    fresh = []
    for _ in range(2):
        engine, made = build()
        load_checkpoint(str(tmp_path / "ck"), made[0], made[1], engine=engine, fresh_noise=True)
        fresh.append(run(made, 3))
    assert whole[3:] != fresh[0] != fresh[1] != whole[3:]


def test_secure_mode_keeps_no_loader_generator_state(monkeypatch):
    """Under ``secure_mode`` Opacus's loader draws from its CSPRNG, which has no state to save
    (torchcsprng's refuses ``get_state``) and must never be replaced by a seeded stream."""
    import types

    from tests.workers_layouts import _stand_in_csprng

    monkeypatch.setitem(__import__("sys").modules, "torchcsprng", types.ModuleType("x"))
    _stand_in_csprng()  # replaces the entry monkeypatch restores afterwards
    model = nn.Sequential(nn.Linear(4, 2))
    engine = PrivacyEngine(secure_mode=True)
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(torch.randn(16, 4), torch.zeros(16).long()), 4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="hooks",
    )
    assert engine.loader_generator is None
