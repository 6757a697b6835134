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


def dtensor_linear_norms(rank: int, world: int) -> dict:
    """Linear ghost norms of DTensor inputs with ``gram_block=4``, against plain tensors."""
    from torch import nn
    from torch.distributed.tensor import Replicate, distribute_tensor

    from opacus_fsdp_sync.layers.linear import GramCache, make_linear_norm_sampler

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    a, g = torch.randn(2, 10, 5), torch.randn(2, 10, 3)
    da, dg = (distribute_tensor(t, mesh, [Replicate()]) for t in (a, g))
    cache = GramCache(4)
    ours = make_linear_norm_sampler(cache)(layer, [da], dg)
    direct = torch.bmm(g.transpose(1, 2), a).flatten(1).norm(dim=1)
    got = ours[layer.weight]
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    bias = ours[layer.bias]
    bias = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
    diff = max((got - direct).abs().max().item(), (bias - g.sum(1).norm(dim=1)).abs().max().item())
    return dict(block_for=cache.block_for(da, dg), diff=diff)


def environment_probe(rank: int, world: int, name: str) -> dict:
    """What a rank sees: an environment variable, its rank, and whether the fork server's
    preload is in it (a module nothing on this rank's own import path loads)."""
    import os
    import sys

    preloaded = "transformers.models.llama.modeling_llama" in sys.modules
    return dict(value=os.environ.get(name), rank=dist.get_rank(), preloaded=preloaded)


def raise_on_rank_one(rank: int, world: int) -> int:
    """Raises on rank 1 only (the harness must report it with its traceback)."""
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank
