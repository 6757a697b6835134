"""Rank functions for the norm tuner: every rank takes rank 0's plan, whatever its batch size."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.tuning import Candidate
from tests.models import SharedInputSeqNet
from tests.private import capture_ghost_log, make_private
from tests.workers_core import _full_params

warnings.filterwarnings("ignore")
D, CLASSES = 16, 8
#: Local batch sizes per rank and sequence lengths per step: ranks differ in batch size; the
#: third step has a length nobody tuned.
LOCAL = (3, 5)
SEQS = (10, 10, 12)


def _data(world: int):
    g = torch.Generator().manual_seed(3)
    n = sum(LOCAL[:world])
    return [
        (torch.randn(n, t, D, generator=g), torch.randint(0, CLASSES, (n, t), generator=g))
        for t in SEQS
    ]


def _costs(key, cand) -> float:
    """Injected on rank 0 only: per-sample gradients for the wide-output layers, else 4-token
    blocks (any other rank that tuned would pick full Grams: timings never reach it)."""
    if cand.per_sample:
        return 1.0 if key.d_out == 20 else 9.0
    return 2.0 if cand.block == 4 else 3.0


def agree_on_rank0_plan(rank: int, world: int) -> dict:
    """FSDP2 (root unit), local batches of 3 and 5, 3 steps; tuning on vs off."""
    records = capture_ghost_log()
    torch.manual_seed(0)
    base = SharedInputSeqNet(D)
    data = _data(world)
    lo = sum(LOCAL[:rank])
    hi = lo + LOCAL[rank]
    out = {}
    for tune in (True, False):
        model = copy.deepcopy(base)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        x0, y0 = data[0]
        engine = PrivacyEngine(tune_norms=tune, timing=True)
        gsm, opt, crit, _ = make_private(engine, model, (x0, y0), x0.shape[0], 0.5, "ghost_fsdp")
        tuner = gsm.norm_tuner
        if tune:
            tuner.blocks = (4,)
            tuner.cost_fn = _costs if rank == 0 else (lambda key, cand: float(cand.block != 0))
        taken = []
        for x, y in data:
            xs, ys = x[lo:hi], y[lo:hi]
            logits = gsm(xs)
            t = xs.shape[1]
            loss = crit(logits.reshape(-1, CLASSES), ys.reshape(-1), shape=(xs.shape[0], t))
            loss.backward()
            taken.append(gsm.per_sample_policy.taken)
            opt.step()
            opt.zero_grad()
        out[tune] = _full_params(model)
        if tune:
            out["table"] = sorted((str(k), str(c)) for k, c in tuner.table.items())
            out["tuned"] = len(tuner.tuned)
            out["agreed"] = tuner.agreed
            out["taken"] = taken
            out["derived"] = sorted(
                (str(k), str(c)) for k, c in tuner._derived.items() if c is not None
            )
    out["on_vs_off"] = max((out[True][k] - out[False][k]).abs().max().item() for k in out[True])
    out["moved"] = max(
        (out[True][k] - p.detach()).abs().max().item() for k, p in base.named_parameters()
    )
    del out[True], out[False]
    out["plan_logged"] = sum(r.startswith("[Ghost] norm plan:") for r in records)
    out["candidate"] = str(Candidate(block=4))
    return out
