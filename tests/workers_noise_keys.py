"""Rank functions for ``tests/test_noise_keys.py``: FSDP2 units on a 1-D and an HSDP mesh.

Each case shards the layouts test's MLP with some layers on a flat mesh of all ranks and the
others on an HSDP ``(replicate=2, shard=2)`` mesh, runs one noised private step and returns,
per parameter, the exact noise this rank drew for its local shard and the parameter after the
step.
"""

from __future__ import annotations

import logging
import warnings

from opacus_fsdp_sync import PrivacyEngine
from tests.private import make_private
from tests.workers_layouts import _base, _data

warnings.filterwarnings("ignore")

#: Which of the MLP's layers go on which mesh, and the root's mesh (the root owns the rest).
CASES = {
    "hsdp_only": ({"l1": "hsdp", "l2": "hsdp", "l3": "hsdp"}, "hsdp"),
    "hsdp_first": ({"l1": "hsdp", "l2": "hsdp", "l3": "flat"}, "hsdp"),
    "flat_first": ({"l1": "flat", "l2": "hsdp", "l3": "hsdp"}, "flat"),
}
#: Two meshes of one shape and no names, ranks in opposite orders: ranks 0 and 1 have equal
#: coordinates on different meshes, so only the parameters a stream covers tell them apart.
SAME_SHAPE = {"reversed": ({"l1": "flat", "l2": "flat", "l3": "reversed"}, "reversed")}


def _drawing_optimizer(opt):
    inner = opt
    while not hasattr(inner, "streams") and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not hasattr(inner, "streams"):
        raise AssertionError(f"no shard-local noise optimizer under {type(opt).__name__}")
    return inner


def _meshes(world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    return {
        "flat": init_device_mesh("cpu", (world,)),
        "hsdp": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")),
        # the same shape as "flat", its ranks in reverse order: rank r has coordinate world-1-r
        "reversed": DeviceMesh("cpu", torch.arange(world - 1, -1, -1)),
    }


def _one_step(case: str, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    meshes = _meshes(world)
    units, root = CASES[case]
    model = _base()
    for name, mesh in units.items():
        fully_shard(getattr(model, name), mesh=meshes[mesh])
    fully_shard(model, mesh=meshes[root])
    x, y = _data(world)
    # dp_seed: a test-only opt-in, so that a failure can be replayed.
    gsm, opt, crit, loader = make_private(
        PrivacyEngine(dp_seed=0), model, (x, y), len(x), 1.0, "ghost_fsdp", noise=1.0, lr=1.0
    )
    inner = _drawing_optimizer(opt)
    drawn: list = []
    draw = inner._draw_noise

    def keep(layout, std):
        out = draw(layout, std)
        drawn.append([t.detach().clone() for t in out])
        return out

    inner._draw_noise = keep
    xb, yb = next(iter(loader))
    crit(gsm(xb), yb).backward()
    opt.step()
    return {
        name: {
            "mesh": tuple(p.device_mesh.mesh.shape),
            "coordinate": tuple(p.device_mesh.get_coordinate()),
            "noise": noise.flatten(),
            "after": p.to_local().detach().clone(),
        }
        for (name, p), noise in zip(model.named_parameters(), drawn[-1], strict=True)
    }


def mixed_meshes(rank: int, world: int) -> dict:
    """One noised step per case of :data:`CASES`."""
    logging.disable(logging.WARNING)
    return {case: _one_step(case, world) for case in CASES}


def same_shape_meshes(rank: int, world: int) -> dict:
    """One noised step per case of :data:`SAME_SHAPE` (2 ranks)."""
    logging.disable(logging.WARNING)
    CASES.update(SAME_SHAPE)
    return {case: _one_step(case, world) for case in SAME_SHAPE}
