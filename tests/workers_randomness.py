"""Rank functions for DP randomness: seeds from OS entropy, no noise replayed on resume."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from tests.workers_layouts import BUILD, _base, _full

warnings.filterwarnings("ignore")

N, BATCH, LR = 200, 20, 1.0


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = 3 * torch.randn(N, 32, generator=g)
    return TensorDataset(x, torch.randint(0, 4, (N,), generator=g))


def _model(layout: str, world: int) -> nn.Module:
    if layout == "single":
        return _base()
    if layout == "fsdp2_hsdp":  # replicas along the first mesh dimension, shards along the second
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model = _base()
        for layer in (model.l1, model.l2, model.l3):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return BUILD[layout.split("_")[0]](layout, world)


def _private(layout: str, world: int, *, dp_seed: int | None, noise: float):
    """The layout made private with Poisson sampling; no ``noise_generator`` (the engine's own)."""
    model = _model(layout, world)
    torch.manual_seed(0)  # the user's public seed, the same in every run
    engine = PrivacyEngine(dp_seed=dp_seed)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(_dataset(), batch_size=BATCH),
        noise_multiplier=noise,
        max_grad_norm=1.0,
        grad_sample_mode="ghost" if layout.split("_")[0] in ("ddp", "single") else "ghost_fsdp",
    )
    return engine, model, gsm, opt, crit, loader


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[n].flatten() for n in sorted(params)])


def _steps(model, gsm, opt, crit, loader, steps: int) -> list[torch.Tensor]:
    """``steps`` optimizer steps; each step's update (the whole model, flattened)."""
    updates = []
    batches = iter(loader)
    for _ in range(steps):
        before = _flat(_full(model))
        xb, yb = next(batches)
        crit(gsm(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        updates.append((before - _flat(_full(model))) / LR)
    return updates


def same_user_seed(rank: int, world: int, layout: str) -> dict:
    """Two runs after ``torch.manual_seed(0)`` without ``dp_seed``, then two with ``dp_seed=7``:
    each run's first draw and first update (noise multiplier 100: the update is mostly noise)."""
    out = {}
    for run, dp_seed in (("entropy_a", None), ("entropy_b", None), ("seed_a", 7), ("seed_b", 7)):
        engine, model, gsm, opt, crit, loader = _private(layout, world, dp_seed=dp_seed, noise=100)
        (update,) = _steps(model, gsm, opt, crit, loader, 1)
        out[run] = {"draw": engine.sampler.global_draw(0).tolist(), "update": update}
    return out


def fresh_noise(rank: int, world: int, phase: str, path: str, steps: int) -> dict:
    """``first``: ``steps`` steps on FSDP2, saved; ``second``: load with ``fresh_noise=True``
    (same ``dp_seed``: without reseeding, rank 0's saved stream would come back) and one step.
    Noise multiplier 1e4: every update is noise."""
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    engine, model, gsm, opt, crit, loader = _private("fsdp2_root", world, dp_seed=3, noise=1e4)
    if phase == "second":
        load_checkpoint(path, gsm, opt, engine=engine, fresh_noise=True)
    updates = _steps(model, gsm, opt, crit, loader, steps)
    if phase == "first":
        save_checkpoint(path, gsm, opt, engine=engine)
    return {"updates": updates, "history": list(engine.accountant.history)}


def cross_layout(rank: int, world: int, phase: str, layout: str, path: str) -> dict:
    """``save``: one step on ``layout``, saved; ``load``: the refusal loading it into ``layout``
    (None if it loaded)."""
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    engine, model, gsm, opt, crit, loader = _private(layout, world, dp_seed=5, noise=1.0)
    if phase == "save":
        _steps(model, gsm, opt, crit, loader, 1)
        save_checkpoint(path, gsm, opt, engine=engine)
        return {}
    try:
        load_checkpoint(path, gsm, opt, engine=engine)
    except Exception as err:  # noqa: BLE001 - the parent judges the message
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}


def one_device_on_rank0(rank: int, world: int) -> dict:
    """Rank 0 alone makes a one-device model private inside the process group (a reference
    computed beside a distributed run): no collective, the whole draw on this process."""
    import torch.distributed as dist

    out = {}
    if rank == 0:
        engine, model, gsm, opt, crit, loader = _private("single", world, dp_seed=None, noise=1.0)
        _steps(model, gsm, opt, crit, loader, 2)
        sampler = engine.sampler
        out = {
            "world": sampler.world_size,
            "sizes_match": all(
                len(sampler.local_share(sampler.global_draw(t))) == len(sampler.global_draw(t))
                for t in range(3)
            ),
            "steps": engine.optimizer_steps,
        }
    dist.barrier()  # rank 1 waits here: a collective on rank 0 alone would hang both
    return out


def rank_masks(rank: int, world: int, n: int, batch: int, draws: int) -> dict:
    """Each mode's Poisson draws on DDP, without and with ``dp_seed``, and with a DataLoader
    ``generator=`` seeded alike on every rank: this rank's share of ``draws`` consecutive draws
    (the records' indices; x[:, 0] is the index), nothing trained."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.zeros(n, 32)
    x[:, 0] = torch.arange(n, dtype=torch.float)
    data = TensorDataset(x, torch.zeros(n, dtype=torch.long))
    out = {}
    cases = [(mode, dp_seed, None) for mode in ("hooks", "ew", "ghost") for dp_seed in (None, 7)]
    cases += [("hooks", None, 5), ("ghost", None, 5)]  # the same loader generator= on each rank
    for mode, dp_seed, loader_seed in cases:
        model = DDP(_base())
        engine = PrivacyEngine(dp_seed=dp_seed)
        given = None if loader_seed is None else torch.Generator().manual_seed(loader_seed)
        *_, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(data, batch_size=batch, generator=given),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode=mode,
        )
        shares = []
        while len(shares) < draws:
            for xb, _ in loader:
                shares.append(sorted(xb[:, 0].long().tolist()))
                if len(shares) == draws:
                    break
        out[(mode, dp_seed, loader_seed)] = shares
    return out


def released_resume(
    rank: int, world: int, layout: str, phase: str, path: str, steps_after: int | None = None
) -> dict:
    """``a``: two steps, a checkpoint, two more steps (their outputs seen); ``b``: a resume from
    the checkpoint with ``fresh_noise=True`` (``steps_after``: the count the user states) that
    takes two steps.

    Returns each step's draw index and global draw, the accountant's steps, or the refusal.
    ``dp_seed`` (the same in both runs) makes a draw index name the same batch in both.
    """
    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    engine, model, gsm, opt, crit, loader = _private(layout, world, dp_seed=3, noise=1.0)
    batches = iter(loader)

    def step() -> tuple[int, list[int]]:
        xb, yb = next(batches)
        crit(gsm(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        index = engine.sampler.handed_out - 1
        return index, engine.sampler.global_draw(index).tolist()

    taken = []
    if phase == "a":
        taken += [step(), step()]
        save_checkpoint(path, gsm, opt, engine=engine)
        taken += [step(), step()]
    else:
        try:
            load_checkpoint(
                path, gsm, opt, engine=engine, fresh_noise=True, steps_after_checkpoint=steps_after
            )
        except Exception as err:  # noqa: BLE001 - the parent judges the message
            return {"error": f"{type(err).__name__}: {err}"}
        taken += [step(), step()]
    return {
        "taken": taken,
        "steps": sum(entry[-1] for entry in engine.accountant.history),
        "epsilon": engine.get_epsilon(1e-5),
        "error": None,
    }
