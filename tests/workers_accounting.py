"""Rank functions for the accountant test: steps with Poisson sampling, then the epsilon."""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from tests.workers_poisson import _private

warnings.filterwarnings("ignore")
N, BATCH, SIGMA, DELTA = 64, 16, 1.1, 1e-5


def accounted_epoch(rank: int, world: int, layout: str, accountant: str) -> dict:
    """One epoch of ``layout`` (a key of ``workers_layouts.BUILD``'s layouts, or ``"single"``)
    with Poisson sampling (Opacus's default); returns the accountant's history and epsilon."""
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(N, 32, generator=g), torch.randint(0, 4, (N,), generator=g))
    engine = PrivacyEngine(accountant=accountant)
    _, _, gsm, opt, crit, loader = _private(layout, world, data, BATCH, 5, SIGMA, engine)
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
