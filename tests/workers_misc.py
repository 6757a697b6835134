"""Rank functions for detection, counter and refusal tests."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel

from opacus_fsdp_sync import (
    CollectiveCounter,
    PrivacyEngine,
    UnsupportedConfigurationError,
    get_fsdp_root_module,
    phase,
)
from tests.models import ToyNet
from tests.private import make_private

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

    data = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    gsm, *_ = make_private(PrivacyEngine(), full, data, 4, 1.0, "ghost_fsdp", lr=0.1)
    mods, api = get_fsdp_root_module(gsm)
    out["fsdp2_through_gsm"] = (api, mods[0] is full)

    ddp = DistributedDataParallel(ToyNet())
    out["ddp"] = get_fsdp_root_module(ddp).api

    fsdp1 = FullyShardedDataParallel(ToyNet(), device_id=torch.device("cpu"), use_orig_params=True)
    out["fsdp1"] = get_fsdp_root_module(fsdp1).api
    try:
        make_private(PrivacyEngine(), fsdp1, data, 4, 1.0, "ghost_fsdp", lr=0.1)
        out["fsdp1_error"] = None
    except UnsupportedConfigurationError as err:
        out["fsdp1_error"] = str(err)

    t = torch.ones(1000)
    with CollectiveCounter() as counter, phase("probe"):
        dist.all_reduce(t)
    out["counter"] = counter.as_dict()
    return out
