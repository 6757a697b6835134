"""Rank functions for the one-backward memory budget under FSDP2 (Poisson sampling, noise 0)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from tests.models import SharedInputSeqNet
from tests.workers_core import _full_params

warnings.filterwarnings("ignore")
N, B, T, D, CLASSES, STEPS, LR = 64, 16, 20, 16, 16, 3, 0.5
#: Bytes one backward keeps per sample of SharedInputSeqNet(16, 16) at T = 20 (fp32): the
#: inputs x (16), h (12) and down's input (20) once each, and the output gradients of q/k/v
#: (3 x 12), gate/up (2 x 20) and down (16), per token.
KEPT = 4 * T * (16 + 12 + 20 + 36 + 40 + 16)
#: Per-sample gradients of all six Linear layers per sample (fp32): q 16x12+12, k and v 16x12,
#: gate 12x20, up 12x20+20, down 20x16+16. At T = 20 the CPU cost rule takes none of them (not
#: cheaper in FLOPs), so only the budget makes a layer keep them.
PER_SAMPLE = 4 * (204 + 192 + 192 + 240 + 260 + 336)
#: Clipping bound (the median per-sample norm, 0.277, of SharedInputSeqNet(16, 16) on dataset()).
C = 0.28


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(N, T, D, generator=g), torch.randint(0, CLASSES, (N, T), generator=g)
    )


def _fsdp2_steps(base, data, budget: int, steps: int):
    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = PrivacyEngine(dp_seed=11, one_backward_memory_budget=budget)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=C,
        grad_sample_mode="ghost_fsdp",
    )
    plans, sizes, draws = [], [], []
    for s, (xb, yb) in enumerate(loader):
        if s == steps:
            break
        n = xb.shape[0]
        crit(gsm(xb).reshape(-1, CLASSES), yb.reshape(-1), shape=(n, T)).backward()
        opt.step()
        opt.zero_grad()
        plan = engine.last_step_memory
        plans.append(dict(outcome=plan.outcome, two_pass=plan.two_pass, other_rank=plan.other_rank))
        sizes.append(n)
        draws.append(engine.sampler.global_draw(s).tolist())
    expected = engine.sampler.sample_rate * engine.sampler.num_samples
    return _full_params(model), plans, sizes, draws, expected


def fsdp2_budgets(rank: int, world: int) -> dict:
    """Rank 0 two-pass, rank 1 unlimited; then a budget that per-sample gradients fit."""
    torch.manual_seed(0)
    base = SharedInputSeqNet(D, CLASSES)
    data = dataset()
    split = 1 if rank == 0 else 2**40
    params_split, plans_split, sizes, draws, expected = _fsdp2_steps(base, data, split, STEPS)
    budget = PER_SAMPLE * max(sizes)  # the same draws follow (the same dp_seed)
    assert budget < KEPT * min(sizes), sizes
    params_psg, plans_psg, sizes_psg, _, _ = _fsdp2_steps(base, data, budget, STEPS)
    assert sizes_psg == sizes
    return dict(
        split=plans_split,
        per_sample=plans_psg,
        params_split=params_split,
        params_per_sample=params_psg,
        draws=draws,
        expected=expected,
    )
