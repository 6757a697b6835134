"""Rank functions for the one-backward step under FSDP2: noise and the generic-layer fallback."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import ToyNet, toy_sample_loss
from tests.private import capture_ghost_log, make_private
from tests.workers_core import B_LOCAL, LR, _data, _full_params, _max_diff, _shard

warnings.filterwarnings("ignore")


class Scale(nn.Module):
    """A layer Opacus has no sampler for (norms via functorch) and we have no formula for."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.weight


class ScaledToy(ToyNet):
    def __init__(self):
        super().__init__()
        self.scale = Scale(32)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.scale(x))


def _steps(engine, base, x, y, rank, world, C, noise, seed, steps=2):
    model = _shard(copy.deepcopy(base), world, "fp32")
    b = B_LOCAL * world
    gen = torch.Generator().manual_seed(seed)
    gsm, opt, crit, _ = make_private(
        engine, model, (x, y), b, C, "ghost_fsdp", noise=noise, lr=LR, noise_generator=gen
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    for s in range(steps):
        xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
        crit(gsm(xs[lo:hi]), ys[lo:hi]).backward()
        opt.step()
        opt.zero_grad()
    return _full_params(model), engine.one_backward


def one_backward_fsdp2(rank: int, world: int) -> dict:
    records = capture_ghost_log()
    torch.manual_seed(0)
    x, y = _data(world, 2)
    b = B_LOCAL * world
    out = {}
    # Noise on, same generator seed: one backward gives the two-pass step.
    base = ToyNet()
    one, used = _steps(PrivacyEngine(), base, x, y, rank, world, 1.0, 1.0, 7)
    two, _ = _steps(PrivacyEngine(one_backward=False), base, x, y, rank, world, 1.0, 1.0, 7)
    out.update(
        noisy_one_vs_two=_max_diff(one, two),
        used_one=used,
        noise_moved=_max_diff(one, {n: p.float() for n, p in _full_params(base).items()}),
    )
    # A layer without a direct formula: FSDP2 falls back to two passes (logged), exact.
    torch.manual_seed(0)
    base = ScaledToy()
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), toy_sample_loss, x[:b], y[:b], 1.0)
    C = norms.median().item()
    ref = copy.deepcopy(base)
    for s in range(2):
        clip_each_sample_step(
            ref, toy_sample_loss, x[s * b : (s + 1) * b], y[s * b : (s + 1) * b], C, LR
        )
    got, used = _steps(PrivacyEngine(), base, x, y, rank, world, C, 0.0, 1)
    out.update(
        generic_vs_loop=_max_diff(got, {n: p.detach() for n, p in ref.named_parameters()}),
        generic_used_one=used,
        clipped=int((norms > C).sum()),
        n=len(norms),
        records=[r for r in records if r.startswith("[Ghost] step:")],
    )
    return out


def handoff_group_by_group(rank: int, world: int) -> dict:
    """Which groups hold unsharded gradients each time FSDP2's post-backward runs.

    The one-backward hand-off computes and reduces one group at a time, so at each group's
    post-backward only that group's unsharded gradients exist (not the whole model's).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from opacus_fsdp_sync.distributed import _fsdp2_internals as internals

    torch.manual_seed(0)
    base = ToyNet()
    x, y = _data(world, 1)
    model = _shard(copy.deepcopy(base), world, "fp32")
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(), model, (x, y), B_LOCAL * world, 0.5, "ghost_fsdp", lr=LR
    )
    groups = list(internals.iter_param_groups([model]))
    calls = []
    orig = FSDPParamGroup.post_backward

    def recording(self, *args, **kwargs):
        live = [
            i
            for i, g in enumerate(groups)
            if any(internals.holds_unsharded_grad(fp) for fp in internals.fsdp_params(g))
        ]
        calls.append((groups.index(self), live))
        return orig(self, *args, **kwargs)

    FSDPParamGroup.post_backward = recording
    try:
        lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
        crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    finally:
        FSDPParamGroup.post_backward = orig
    opt.step()
    return {"calls": calls, "n_groups": len(groups)}


def failed_handoff_leaves_nothing(rank: int, world: int, fail_at_call: int) -> dict:
    """A step whose hand-off raises at the ``fail_at_call``-th group post-backward, caught.

    Returns the unreduced gradients left on FSDP2 after the failure and the parameters after
    two more steps, against a run that skipped the failed batch without trying it.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from opacus_fsdp_sync.distributed import _fsdp2_internals as internals

    torch.manual_seed(0)
    base = ToyNet()
    x, y = _data(world, 3)
    b = B_LOCAL * world
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    out = {}
    for failing in (False, True):
        model = _shard(copy.deepcopy(base), world, "fp32")
        gsm, opt, crit, _ = make_private(
            PrivacyEngine(), model, (x, y), b, 0.5, "ghost_fsdp", lr=LR
        )
        if failing:
            orig, calls = FSDPParamGroup.post_backward, []

            def failing_post_backward(self, *args, _calls=calls, _orig=orig):
                _calls.append(1)
                if len(_calls) == fail_at_call:
                    raise RuntimeError("injected hand-off failure")
                return _orig(self, *args)

            FSDPParamGroup.post_backward = failing_post_backward
            try:
                crit(gsm(x[2 * b : 3 * b][lo:hi]), y[2 * b : 3 * b][lo:hi]).backward()
            except RuntimeError as err:
                out["error"] = str(err)
            finally:
                FSDPParamGroup.post_backward = orig
            out["calls"] = len(calls)
            groups = list(internals.iter_param_groups([model]))
            out["unreduced_left"] = sum(
                internals.holds_unsharded_grad(fp)
                for g in groups
                for fp in internals.fsdp_params(g)
            )
            opt.zero_grad()
        for s in range(2):
            crit(gsm(x[s * b : (s + 1) * b][lo:hi]), y[s * b : (s + 1) * b][lo:hi]).backward()
            opt.step()
            opt.zero_grad()
        out[failing] = _full_params(model)
    out["diff"] = _max_diff(out.pop(True), out.pop(False))
    return out
