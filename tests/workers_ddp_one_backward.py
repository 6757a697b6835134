"""Rank functions for the one-backward step under DDP (our bucketed all-reduce as hand-off)."""

from __future__ import annotations

import copy
import logging
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine, phase
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import toy_sample_loss
from tests.private import make_private
from tests.workers_core import B_LOCAL, LR, _max_diff
from tests.workers_ddp import EmbedNet, _token_data

warnings.filterwarnings("ignore")
STEPS = 3


def _sum_loss(m, a, t):
    return nn.functional.cross_entropy(m(a), t, reduction="sum")


def _local(t, s, b, rank, lo=0, hi=B_LOCAL):
    return t[s * b : (s + 1) * b][rank * B_LOCAL + lo : rank * B_LOCAL + hi]


def _train(
    engine,
    base,
    data,
    rank,
    world,
    C,
    *,
    steps=STEPS,
    noise=0.0,
    seed=1,
    reduction="mean",
    micro=1,
    ddp_kwargs=None,
    lr=LR,
    setup=None,
):
    """``steps`` private steps on DDP; each rank's batch split into ``micro`` virtual steps."""
    x, y = data
    b = B_LOCAL * world
    model = DDP(copy.deepcopy(base), **(ddp_kwargs or {}))
    if setup is not None:
        setup(model)
    gen = torch.Generator().manual_seed(seed)
    gsm, opt, crit, _ = make_private(
        engine,
        model,
        (x, y),
        b,
        C,
        "ghost",
        noise=noise,
        lr=lr,
        noise_generator=gen,
        loss_reduction=reduction,
        criterion=nn.CrossEntropyLoss(reduction=reduction),
    )
    counts, timings = [], []
    part = B_LOCAL // micro
    for s in range(steps):
        with CollectiveCounter() as counter:
            for k in range(micro):
                lo, hi = k * part, (k + 1) * part
                with phase("forward"):
                    out = gsm(_local(x, s, b, rank, lo, hi))
                crit(out, _local(y, s, b, rank, lo, hi)).backward()
                with phase("optimizer_step"):
                    opt.signal_skip_step(do_skip=k < micro - 1)
                    opt.step()
                    opt.zero_grad()
        counts.append(counter.as_dict())
        timings.append(sorted(engine.last_step_timings))
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return dict(params=params, counts=counts, timings=timings, one=engine.one_backward), (
        model,
        gsm,
    )


def _nonprivate_counts(base, data, rank, world, steps=STEPS, ddp_kwargs=None):
    """Collectives of plain DDP steps (forward, backward, SGD step) on the same batches."""
    x, y = data
    b = B_LOCAL * world
    model = DDP(copy.deepcopy(base), **(ddp_kwargs or {}))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    counts = []
    for s in range(steps):
        with CollectiveCounter() as counter:
            loss = nn.functional.cross_entropy(model(_local(x, s, b, rank)), _local(y, s, b, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
        counts.append(counter.as_dict())
    return counts


def _reference(base, data, world, C, loss_fn=toy_sample_loss, reduction="mean", lr=LR):
    x, y = data
    b = B_LOCAL * world
    ref = copy.deepcopy(base)
    for s in range(STEPS):
        xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
        clip_each_sample_step(ref, loss_fn, xs, ys, C, lr, loss_reduction=reduction)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def ddp_one_backward(rank: int, world: int) -> dict:
    """One backward vs two passes vs the loop; counts against the non-private step; noise."""
    records, stop_recording = _records()
    torch.manual_seed(0)
    base = EmbedNet()
    data = _token_data(world, STEPS)
    b = B_LOCAL * world
    x, y = data
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), toy_sample_loss, x[:b], y[:b], 1.0)
    C = norms.median().item()
    out = {"clipped": int((norms > C).sum()), "n": len(norms)}
    one, _ = _train(PrivacyEngine(timing=True), base, data, rank, world, C)
    two, _ = _train(PrivacyEngine(one_backward=False, timing=True), base, data, rank, world, C)
    stop_recording()
    out.update(
        one_used=one["one"],
        two_used=two["one"],
        one_counts=one["counts"],
        two_counts=two["counts"],
        one_timings=one["timings"],
        nonprivate_counts=_nonprivate_counts(base, data, rank, world),
        one_vs_two=_max_diff(one["params"], two["params"]),
        one_vs_loop=_max_diff(one["params"], _reference(base, data, world, C)),
        records=records,
    )
    # loss_reduction="sum": the optimizer scales the averaged gradient back by the world size
    lr_sum = LR / b
    one_s, _ = _train(PrivacyEngine(), base, data, rank, world, C, reduction="sum", lr=lr_sum)
    two_s, _ = _train(
        PrivacyEngine(one_backward=False), base, data, rank, world, C, reduction="sum", lr=lr_sum
    )
    ref_s = _reference(base, data, world, C, _sum_loss, "sum", lr_sum)
    out.update(
        sum_used=one_s["one"],
        sum_one_vs_two=_max_diff(one_s["params"], two_s["params"]),
        sum_one_vs_loop=_max_diff(one_s["params"], ref_s),
    )
    # Noise on, same seed: the same shared draw on both paths
    noisy1, _ = _train(PrivacyEngine(), base, data, rank, world, C, noise=1.0, seed=5)
    noisy2, _ = _train(
        PrivacyEngine(one_backward=False), base, data, rank, world, C, noise=1.0, seed=5
    )
    out.update(
        noisy_moved=_max_diff(noisy1["params"], one["params"]),
        noisy_one_vs_two=_max_diff(noisy1["params"], noisy2["params"]),
    )
    # Two micro-batches per rank and step through Opacus's virtual steps
    acc1, _ = _train(PrivacyEngine(), base, data, rank, world, C, micro=2)
    acc2, _ = _train(PrivacyEngine(one_backward=False), base, data, rank, world, C, micro=2)
    out.update(
        acc_used=acc1["one"],
        acc_counts=acc1["counts"],
        acc_one_vs_two=_max_diff(acc1["params"], acc2["params"]),
        acc_vs_full=_max_diff(acc1["params"], one["params"]),
    )
    return out


def ddp_reducer_stays_consistent(rank: int, world: int, ddp_kwargs: dict) -> dict:
    """Twelve one-backward steps (past DDP's first ten logged iterations), then a plain step.

    DDP arms its reducer in every forward but sees no parameter gradient: it must never
    complain, never all-reduce by itself during the private steps, and still average a normal
    backward afterwards.
    """
    torch.manual_seed(0)
    base = EmbedNet()
    steps = 12
    data = _token_data(world, steps + 1)
    one, (model, gsm) = _train(
        PrivacyEngine(), base, data, rank, world, 1.0, steps=steps, ddp_kwargs=ddp_kwargs
    )
    x, y = data
    b = B_LOCAL * world
    gsm.disable_hooks()
    for p in model.parameters():
        p.grad = None
    ref = copy.deepcopy(base)  # the trained parameters, without Opacus's hooks
    ref.load_state_dict(model.module.state_dict())
    xs, ys = x[steps * b : (steps + 1) * b], y[steps * b : (steps + 1) * b]
    nn.functional.cross_entropy(ref(xs), ys).backward()  # the global batch on one process
    with CollectiveCounter() as counter:
        loss = nn.functional.cross_entropy(
            model(_local(x, steps, b, rank)), _local(y, steps, b, rank)
        )
        loss.backward()
    got = {n: p.grad for n, p in model.module.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    return dict(
        used=one["one"],
        counts=one["counts"],
        plain_counts=counter.as_dict(),
        plain_vs_global=_max_diff(got, want),
    )


def _records():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("opacus_fsdp_sync")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return records, lambda: log.removeHandler(handler)


def ddp_buckets_and_comm_hook(rank: int, world: int) -> dict:
    """Several buckets (a small ``bucket_cap_mb``); a communication hook takes two passes."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    base = EmbedNet()
    data = _token_data(world, STEPS)
    C = 0.5
    ref = _reference(base, data, world, C)
    small = {"bucket_cap_mb": 2000 / 2**20}  # about 2 kB: the 6.5 kB model spans buckets
    one, _ = _train(PrivacyEngine(), base, data, rank, world, C, ddp_kwargs=small)
    records, done = _records()
    hooked, _ = _train(
        PrivacyEngine(),
        base,
        data,
        rank,
        world,
        C,
        setup=lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook),
    )
    done()
    return dict(
        used=one["one"],
        counts=one["counts"],
        nonprivate_counts=_nonprivate_counts(base, data, rank, world, ddp_kwargs=small),
        vs_loop=_max_diff(one["params"], ref),
        hook_used=hooked["one"],
        hook_vs_loop=_max_diff(hooked["params"], ref),
        records=records,
    )


def ddp_static_graph_refused(rank: int, world: int) -> str:
    """``static_graph=True`` with the activations-only pass is refused with the way out."""
    x, y = _token_data(world, 1)
    model = DDP(EmbedNet(), static_graph=True)
    try:
        make_private(PrivacyEngine(), model, (x, y), B_LOCAL * world, 1.0, "ghost", lr=LR)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"
