"""Rank functions and layers for the layer-subclass tests (run by ``run_ranks``)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers import room_for
from opacus_fsdp_sync.layers.registry import layer_type
from opacus_fsdp_sync.testing import per_sample_clipped_grads
from tests.private import make_private
from tests.workers_core import _full_params, _max_diff

warnings.filterwarnings("ignore")


class GeluLinear(nn.Linear):
    """A ``Linear`` whose own ``forward`` applies a GELU and doubles: another function."""

    def forward(self, x):
        return nn.functional.gelu(super().forward(x)) * 2.0


class TaggedLinear(nn.Linear):
    """A ``Linear`` that only carries an attribute: it computes what ``nn.Linear`` does."""

    tag = "adapter"


class _Block(nn.Module):
    def __init__(self, layer: nn.Module, d: int) -> None:
        super().__init__()
        self.layer, self.norm = layer, nn.LayerNorm(d)

    def forward(self, x):
        return x + self.norm(torch.tanh(self.layer(x)))


class _Net(nn.Module):
    """Input ``Linear``, a block with the subclass, a plain block, a head; pooled over tokens."""

    def __init__(self, cls: type, d: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([_Block(cls(d, d), d), _Block(nn.Linear(d, d), d)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).mean(1)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def linear_subclass_fsdp2(rank: int, world: int, kind: str) -> dict:
    """One FSDP2 step (default options) of a model with a ``Linear`` subclass, against the loop.

    Args:
        rank: This rank.
        world: Number of ranks.
        kind: ``"overrides"`` (:class:`GeluLinear`) or ``"keeps"`` (:class:`TaggedLinear`).
    """
    torch.manual_seed(0)
    base = _Net(GeluLinear if kind == "overrides" else TaggedLinear)
    b_local, t, d = 3, 5, 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * b_local, t, d, generator=g)
    y = torch.randint(0, 4, (world * b_local,), generator=g)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), _loss, x, y, 1.0)
    C = 0.5 * norms.min().item()  # every sample clipped
    ref, norms = per_sample_clipped_grads(copy.deepcopy(base), _loss, x, y, C)

    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = PrivacyEngine()
    gsm, opt, crit, _ = make_private(
        engine, model, (x, y), world * b_local, C, "ghost_fsdp", lr=1.0
    )
    lo, hi = rank * b_local, (rank + 1) * b_local
    crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
    now, start = _full_params(model), _full_params(base)
    # SGD with lr=1: each parameter moved by its clipped gradient
    moved = {n: start[n] - now[n] for n in start}
    layer = model.blocks[0].layer
    room, norm = room_for(layer, layer_type(layer)), gsm.NORM_SAMPLERS.get(layer_type(layer))
    return dict(
        all_clipped=bool((norms > C).all()),
        one_backward=engine.one_backward,
        room=room.name,
        # the room's own norm, or none (Opacus's per-sample gradients by functorch)
        norm="room" if norm is room.norm else "functorch" if norm is None else repr(norm),
        vs_loop=_max_diff(moved, {n: v.float() for n, v in ref.items()}),
        moved=_max_diff(now, start),
    )
