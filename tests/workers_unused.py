"""Rank functions for the unused-layer tests (run by opacus_fsdp_sync.testing.run_ranks)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import make_private
from tests.workers_core import LR, _full_params, _max_diff

warnings.filterwarnings("ignore")


class SkipNet(nn.Module):
    """Three blocks, an extra residual Linear and a head; ``skip`` names what a forward leaves out.

    ``skip`` holds block indices and/or ``"extra"``: a flag the training loop sets per step.
    """

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.Tanh()),
                nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()),
                nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.Tanh()),
            ]
        )
        self.extra = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.skip: set = set()

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        if "extra" not in self.skip:
            x = x + torch.tanh(self.extra(x))
        return self.head(x)


def skip_sample_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


#: ``(what the forward skips, samples per rank)`` per step: block 1 (its own FSDP unit) and the
#: extra Linear (in the root unit) unused in the first step, each again later, batch sizes
#: varying.
FSDP_SCHEDULE = [({1, "extra"}, 4), (set(), 4), ({1}, 3), ({"extra"}, 2)]


def unused_layers_fsdp2(rank: int, world: int, options: dict) -> dict:
    """FSDP2 steps with layers skipped per :data:`FSDP_SCHEDULE` against the loop."""
    torch.manual_seed(0)
    base = SkipNet()
    n_local = sum(b for _, b in FSDP_SCHEDULE)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(world * n_local, 16, generator=g)
    y = torch.randint(0, 8, (world * n_local,), generator=g)
    first = world * FSDP_SCHEDULE[0][1]
    probe = copy.deepcopy(base)
    probe.skip = FSDP_SCHEDULE[0][0]
    _, norms0 = per_sample_clipped_grads(probe, skip_sample_loss, x[:first], y[:first], 1.0)
    C = norms0.median().item()

    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = PrivacyEngine(**options)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), first, C, "ghost_fsdp", lr=LR)
    ref = copy.deepcopy(base)
    out = dict(one_backward=engine.one_backward, steps=[])
    offset = 0
    for skip, b in FSDP_SCHEDULE:
        xs, ys = x[offset : offset + world * b], y[offset : offset + world * b]
        offset += world * b
        ref.skip, model.skip = skip, skip
        # The engine averages over ranks and divides by the expected batch per rank.
        lr = LR / (world * opt.expected_batch_size)
        ref_norms = clip_each_sample_step(ref, skip_sample_loss, xs, ys, C, lr, "sum")
        crit(gsm(xs[rank * b : (rank + 1) * b]), ys[rank * b : (rank + 1) * b]).backward()
        norms = gsm.per_sample_gradient_norms.detach().clone()
        opt.step()
        opt.zero_grad()
        if not out["steps"]:  # what the first step skipped has a zero gradient: unchanged
            now, start = _full_params(model), _full_params(base)
            out["skipped_unchanged"] = [
                (now[n] == start[n]).all().item()
                for n in start
                if n.startswith(("blocks.1.", "extra."))
            ]
        local = ref_norms[rank * b : (rank + 1) * b]
        out["steps"].append(
            dict(
                clipped=int((ref_norms > C).sum()),
                n=len(ref_norms),
                norms_rel_err=((norms - local) / local).abs().max().item(),
                vs_loop=_max_diff(
                    _full_params(model), {n: p.detach() for n, p in ref.named_parameters()}
                ),
            )
        )
    out["moved"] = _max_diff(
        _full_params(model), {n: p.detach() for n, p in base.named_parameters()}
    )
    return out
