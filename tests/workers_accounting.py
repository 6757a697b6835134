"""Rank functions for the accountant test: steps with Poisson sampling, then the epsilon."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from tests.workers_layouts import BUILD

warnings.filterwarnings("ignore")
N, BATCH, SIGMA, DELTA = 64, 16, 1.1, 1e-5


def accounted_epoch(rank: int, world: int, layout: str, accountant: str) -> dict:
    """One epoch of ``layout`` (a key of ``workers_layouts.BUILD``'s layouts, or ``"single"``)
    with Poisson sampling (Opacus's default); returns the accountant's history and epsilon."""
    from tests.workers_layouts import _base

    api = layout.split("_")[0]
    model = _base() if layout == "single" else BUILD[api](layout, world)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(N, 32, generator=g), torch.randint(0, 4, (N,), generator=g))
    engine = PrivacyEngine(accountant=accountant)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        grad_sample_mode="ghost" if api in ("single", "ddp") else "ghost_fsdp",
    )
    steps = 0
    for xb, yb in loader:
        crit(gsm(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    return {
        "history": list(engine.accountant.history),
        "epsilon": engine.get_epsilon(DELTA),
        "steps": steps,
    }
