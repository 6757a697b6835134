"""Rank functions for the FSDP2 noise: one independent draw per coordinate, replicas equal."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from tests.workers_core import B_LOCAL, _data, _full_params

warnings.filterwarnings("ignore")


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 256), nn.ReLU())
        self.head = nn.Linear(256, 64)

    def forward(self, x):
        return self.head(self.block(x))


def _step(base, x, y, rank, world, strategy, noise):
    cfg = ShardingConfig(strategy=strategy, wrap_policy="size_based", min_num_params=1000)
    model = shard_model(copy.deepcopy(base), cfg, device=torch.device("cpu"))
    b = B_LOCAL * world
    gsm, opt, crit, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=b),
        noise_multiplier=noise,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode="ghost_fsdp",
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
    return _full_params(model), type(opt).__name__


def noise_draws(rank: int, world: int, strategy: str) -> dict:
    """The noise of one step, in units of its standard deviation (sigma C / (W b))."""
    torch.manual_seed(0)  # every rank seeded identically: the dangerous case
    base = Wide()
    x, y = _data(world, 1)
    y = y % 64
    noisy, name = _step(base, x, y, rank, world, strategy, 1.0)
    clean, _ = _step(base, x, y, rank, world, strategy, 0.0)
    b = B_LOCAL * world
    per_param = {n: (clean[n] - noisy[n]) * b for n in sorted(clean)}
    noise = torch.cat([t.flatten() for t in per_param.values()])
    return {"noise": noise, "per_param": per_param, "optimizer": name}
