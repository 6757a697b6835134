"""Rank functions for detection, counter and refusal tests."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import (
    CollectiveCounter,
    PrivacyEngine,
    UnsupportedConfigurationError,
    get_fsdp_root_module,
    phase,
)
from tests.models import ToyNet

warnings.filterwarnings("ignore")


def detection(rank: int, world: int) -> dict:
    out = {}
    mesh = init_device_mesh("cpu", (world,))
    full = ToyNet()
    for b in full.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(full, mesh=mesh)
    mods, api = get_fsdp_root_module(full)
    out["fsdp2_root"] = (api, len(mods), mods[0] is full)

    blocks_only = ToyNet()
    for b in blocks_only.blocks:
        fully_shard(b, mesh=mesh)
    mods, api = get_fsdp_root_module(blocks_only)
    out["fsdp2_blocks_only"] = (api, len(mods), all(m in list(blocks_only.blocks) for m in mods))

    loader = DataLoader(TensorDataset(torch.randn(8, 16), torch.randint(0, 8, (8,))), batch_size=4)
    gsm, *_ = PrivacyEngine().make_private(
        module=full,
        optimizer=torch.optim.SGD(full.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode="ghost_fsdp",
    )
    mods, api = get_fsdp_root_module(gsm)
    out["fsdp2_through_gsm"] = (api, mods[0] is full)

    ddp = DistributedDataParallel(ToyNet())
    out["ddp"] = get_fsdp_root_module(ddp).api

    fsdp1 = FullyShardedDataParallel(ToyNet(), device_id=torch.device("cpu"), use_orig_params=True)
    out["fsdp1"] = get_fsdp_root_module(fsdp1).api
    try:
        PrivacyEngine().make_private(
            module=fsdp1,
            optimizer=torch.optim.SGD(fsdp1.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="ghost_fsdp",
        )
        out["fsdp1_error"] = None
    except UnsupportedConfigurationError as err:
        out["fsdp1_error"] = str(err)

    t = torch.ones(1000)
    with CollectiveCounter() as counter, phase("probe"):
        dist.all_reduce(t)
    out["counter"] = counter.as_dict()
    return out
