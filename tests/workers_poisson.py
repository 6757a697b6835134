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
CONFIGS = {"tiny": dict(n=40, batch=2, physical=None), "bmm": dict(n=64, batch=16, physical=3)}


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(3 * torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g))


def _private(layout, world, data, batch, seed, noise=0.0, engine=None):
    api = layout.split("_")[0]
    model = _base() if api == "single" else BUILD[api](layout, world)
    torch.manual_seed(seed)  # rank 0's draw of the shared seed
    engine = engine or PrivacyEngine()
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
            ctx = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                                     optimizer=opt)
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
    for seed in seeds:
        engine, _, gsm, opt, crit, loader = _private(layout, world, data, cfg["batch"], seed)
        sampler = engine.sampler
        logical, physical, sizes = _train(gsm, opt, crit, loader, cfg["physical"])
        globals_ = [int(sampler.global_draw(t).numel()) for t in range(len(sampler))]
        out[seed] = dict(logical=logical, physical=physical, sizes=sizes, globals=globals_,
                         completed=sampler.completed, steps=len(sampler),
                         history=list(engine.accountant.history))
    return out


def _full_named(model):
    from tests.workers_layouts import _full

    return _full(model)


def resume(rank: int, world: int, layout: str, path: str, phase: str, k: int, total: int) -> dict:
    """``phase="straight"``: ``total`` steps; ``"first"``: ``k`` steps then save;
    ``"second"``: fresh processes, load, the remaining ``total - k`` steps. Noise on."""
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    cfg = CONFIGS["bmm"]
    data = _dataset(cfg["n"])
    seed = 11 if phase != "second" else 999  # the resumed run must not depend on its own seeds
    engine, model, gsm, opt, crit, loader = _private(
        layout, world, data, cfg["batch"], seed, noise=1.0
    )
    if phase == "second":
        load_checkpoint(path, gsm, opt, engine=engine)
    steps = k if phase == "first" else total - k if phase == "second" else total
    done = 0
    while done < steps:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=cfg["physical"],
                                optimizer=opt) as batches:
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
    return {"params": _full_named(model), "epsilon": engine.get_epsilon(1e-5),
            "completed": engine.sampler.completed}
