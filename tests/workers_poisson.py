"""Rank functions for distributed Poisson sampling: no desync, exact steps, resumable state."""

from __future__ import annotations

import warnings

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from tests.workers_layouts import BUILD, _base

warnings.filterwarnings("ignore")
#: Tiny expected batches (empty local and global draws are common) and larger ones with the
#: memory manager's physical batches.
CONFIGS = {
    "tiny": dict(n=20, batch=2, physical=None),
    "bmm": dict(n=24, batch=3, physical=1),
    "resume": dict(n=24, batch=8, physical=2),
}


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(
        3 * torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)
    )


def _private(layout, world, data, batch, seed, noise=0.0, engine=None):
    api = layout.split("_")[0]
    model = _base() if api == "single" else BUILD[api](layout, world)
    torch.manual_seed(seed)  # model initialisation only: DP seeds never follow it
    # The explicit opt-in to reproducible draws: these tests compare runs draw for draw.
    engine = engine or PrivacyEngine(dp_seed=seed)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=noise,
        max_grad_norm=1.0,
        grad_sample_mode="ghost" if api in ("ddp", "single") else "ghost_fsdp",
        noise_generator=torch.Generator().manual_seed(seed + 1),
    )
    return engine, model, gsm, opt, crit, loader


def _train(gsm, opt, crit, loader, physical, epochs=1, record=None):
    logical = physical_batches = 0
    sizes = []
    for _ in range(epochs):
        if physical is None:
            batches = loader
            ctx = None
        else:
            ctx = BatchMemoryManager(
                data_loader=loader, max_physical_batch_size=physical, optimizer=opt
            )
            batches = ctx.__enter__()
        for xb, yb in batches:
            sizes.append(len(xb))
            if record is not None:
                record.append(xb.clone())
            crit(gsm(xb), yb).backward()
            physical_batches += 1
            skipped = opt._check_skip_next_step(pop_next=False)
            opt.step()
            opt.zero_grad()
            logical += not skipped
    return logical, physical_batches, sizes


def no_desync(rank: int, world: int, layout: str, config: str, seeds: list[int]) -> dict:
    """Every seed's epoch: logical and physical step counts, local sizes, global counts."""
    cfg = CONFIGS[config]
    data = _dataset(cfg["n"])
    out = {}
    engine, _, gsm, opt, crit, loader = _private(layout, world, data, cfg["batch"], 0)
    sampler = engine.sampler
    for seed in seeds:
        sampler.seed, sampler.completed = seed, 0  # a fresh shared draw sequence per seed
        logical, physical, sizes = _train(gsm, opt, crit, loader, cfg["physical"])
        globals_ = [int(sampler.global_draw(t).numel()) for t in range(len(sampler))]
        out[seed] = dict(
            logical=logical,
            physical=physical,
            sizes=sizes,
            globals=globals_,
            completed=sampler.completed,
            steps=len(sampler),
        )
    return out


class _NoOptimizer:
    def signal_skip_step(self, do_skip=True):
        pass


def opacus_counts(rank: int, world: int, config: str, seeds: list[int]) -> dict:
    """The same count harness over Opacus's own distributed sampler and memory manager."""
    from opacus.data_loader import DPDataLoader
    from opacus.utils.batch_memory_manager import BatchSplittingSampler

    cfg = CONFIGS[config]
    data = _dataset(cfg["n"])
    out = {}
    for seed in seeds:
        # Seeded per rank (identically seeded ranks would draw the same pattern of sizes over
        # their own shards: correlated samples, and the same counts by accident).
        torch.manual_seed(1000 * seed + rank)
        loader = DPDataLoader.from_data_loader(
            DataLoader(data, batch_size=cfg["batch"]), distributed=True
        )
        sampler = loader.batch_sampler
        if cfg["physical"] is not None:
            sampler = BatchSplittingSampler(
                sampler=sampler, max_batch_size=cfg["physical"], optimizer=_NoOptimizer()
            )
        out[seed] = sum(1 for _ in sampler)
    return out


def exact_steps(rank: int, world: int, layout: str, steps: int) -> dict:
    """Noise 0, Poisson with physical batches of 1: parameters after ``steps`` logical steps,
    and the global selections they used (for the clip-each-sample loop)."""
    data = _dataset(CONFIGS["tiny"]["n"])
    engine, model, gsm, opt, crit, loader = _private(layout, world, data, 2, 3)
    selections, local_sizes = [], []
    done = 0
    while done < steps:  # over epochs
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=opt) as b:
            for xb, yb in b:
                if len(local_sizes) <= done:
                    local_sizes.append(0)
                    selections.append(engine.sampler.global_draw(done).tolist())
                local_sizes[done] += len(xb)
                crit(gsm(xb), yb).backward()
                skipped = opt._check_skip_next_step(pop_next=False)
                opt.step()
                opt.zero_grad()
                done += not skipped
                if done == steps:
                    break
    return {
        "params": _full_named(model),
        "selections": selections,
        "local_sizes": local_sizes,
        "expected_batch": engine.sampler.sample_rate * engine.sampler.num_samples,
    }


def _full_named(model):
    from tests.workers_layouts import _full

    return _full(model)


def resume(rank: int, world: int, layout: str, path: str, phase: str, k: int, total: int) -> dict:
    """``phase="straight"``: ``total`` steps; ``"first"``: ``k`` steps then save;
    ``"second"``: fresh processes, load, the remaining ``total - k`` steps; ``"no_dp_state"``:
    the same, loading model and optimizer only. Noise on."""
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    cfg = CONFIGS["resume"]
    data = _dataset(cfg["n"])
    resumed = phase in ("second", "no_dp_state")
    seed = 999 if resumed else 11  # a resumed run must not depend on its own seeds
    engine, model, gsm, opt, crit, loader = _private(
        layout, world, data, cfg["batch"], seed, noise=1.0
    )
    if resumed:
        load_checkpoint(path, gsm, opt, engine=engine if phase == "second" else None)
    steps = k if phase == "first" else total - k if resumed else total
    done = 0
    while done < steps:
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=cfg["physical"], optimizer=opt
        ) as batches:
            for xb, yb in batches:
                crit(gsm(xb), yb).backward()
                skipped = opt._check_skip_next_step(pop_next=False)
                opt.step()
                opt.zero_grad()
                done += not skipped
                if done == steps and not skipped:
                    break
    if phase == "first":
        save_checkpoint(path, gsm, opt, engine=engine)
    return {
        "params": _full_named(model),
        "epsilon": engine.get_epsilon(1e-5),
        "completed": engine.sampler.completed,
    }


def bad_checkpoints(rank: int, world: int, path: str) -> dict:
    """Loading a checkpoint into another configuration: the errors users see."""
    from opacus_fsdp_sync.sharding import load_checkpoint

    cfg = CONFIGS["resume"]
    data = _dataset(cfg["n"])
    out = {}
    engine, model, gsm, opt, crit, loader = _private(
        "fsdp2_root", world, data, cfg["batch"], 1, noise=0.5
    )
    try:
        load_checkpoint(path, gsm, opt, engine=engine)
    except Exception as err:  # noqa: BLE001
        out["noise"] = f"{type(err).__name__}: {err}"
    engine, model, gsm, opt, crit, loader = _private("fsdp2_root", world, data, 4, 1, noise=1.0)
    try:
        load_checkpoint(path, gsm, opt, engine=engine)
    except Exception as err:  # noqa: BLE001
        out["batch"] = f"{type(err).__name__}: {err}"
    for fresh in (False, True):  # the saved configuration: only the world size may differ
        engine, model, gsm, opt, crit, loader = _private(
            "fsdp2_root", world, data, cfg["batch"], 1, noise=1.0
        )
        try:
            load_checkpoint(path, gsm, opt, engine=engine, fresh_noise=fresh)
            out[f"same_fresh_{fresh}"] = (None, list(engine.accountant.history))
        except Exception as err:  # noqa: BLE001
            out[f"same_fresh_{fresh}"] = (f"{type(err).__name__}: {err}", None)
    return out


def llama_empty_ranks(rank: int, world: int, steps: int) -> dict:
    """A tiny FSDP2 Llama (whose attention cannot run a zero-size batch) under Poisson sampling
    with about one example per step: parameters after ``steps`` steps and the selections."""
    from opacus_fsdp_sync.models import LlamaSpec, build_llama
    from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
    from tests.private import lm_loss

    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny"))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, base.config.vocab_size, (8, 6), generator=g)
    model = shard_model(base, ShardingConfig(), device=torch.device("cpu"))
    engine = PrivacyEngine()
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(ids), batch_size=1),
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        grad_sample_mode="ghost_fsdp",
    )
    engine.sampler.seed = 2
    sizes, done = [], 0
    while done < steps:
        for (xb,) in loader:
            sizes.append(len(xb))
            lm_loss(gsm, crit, xb).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
    return {
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "selections": [engine.sampler.global_draw(t).tolist() for t in range(steps)],
        "sizes": sizes,
        "ids": ids,
        "expected_batch": engine.sampler.sample_rate * engine.sampler.num_samples,
    }
