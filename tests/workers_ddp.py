"""Rank functions for DDP (and DPDDP) ghost clipping."""

from __future__ import annotations

import copy
import warnings

import opacus
import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine, phase
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import toy_sample_loss
from tests.private import lm_loss, make_private
from tests.workers_core import B_LOCAL, LR, _max_diff

warnings.filterwarnings("ignore")


class EmbedNet(nn.Module):
    """A token model (its first layer's input needs no gradient, as in a language model)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x):
        return self.body(self.emb(x).mean(1))


def _token_data(world, steps):
    g = torch.Generator().manual_seed(3)
    n = B_LOCAL * world * steps
    return torch.randint(0, 50, (n, 6), generator=g), torch.randint(0, 8, (n,), generator=g)


def _train(engine, model, x, y, rank, world, C, steps, noise, seed, local=True, wrap=DDP):
    b = B_LOCAL * world
    if wrap is not None:
        model = wrap(model)
    gen = torch.Generator().manual_seed(seed)
    gsm, opt, crit, _ = make_private(
        engine, model, (x, y), b, C, "ghost", noise=noise, lr=LR, noise_generator=gen
    )
    _train.drawn_ahead = drawn = []  # steps whose noise was drawn during the backward
    if hasattr(opt, "prefetch_noise"):
        ahead = opt.prefetch_noise

        def counting():
            ahead()
            drawn.append(getattr(opt, "_prefetched", None) is not None)

        opt.prefetch_noise = counting
    counts = []
    for s in range(steps):
        xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
        if local:
            xs, ys = (
                xs[rank * B_LOCAL : (rank + 1) * B_LOCAL],
                ys[rank * B_LOCAL : (rank + 1) * B_LOCAL],
            )
        with CollectiveCounter() as counter:
            with phase("forward"):
                out = gsm(xs)
            crit(out, ys).backward()
            with phase("optimizer_step"):
                opt.step()
                opt.zero_grad()
        counts.append(counter.as_dict())
    inner = model.module if hasattr(model, "module") else model
    params = {n: p.detach().clone() for n, p in inner.named_parameters()}
    return params, counts, type(opt).__name__


def ddp_exactness(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = EmbedNet()
    x, y = _token_data(world, 2)
    b = B_LOCAL * world

    def loss_fn(m, a, t):
        return toy_sample_loss(m, a, t)

    _, norms0 = per_sample_clipped_grads(copy.deepcopy(base), loss_fn, x[:b], y[:b], 1.0)
    C = norms0.median().item()
    ref = copy.deepcopy(base)
    for s in range(2):
        clip_each_sample_step(ref, loss_fn, x[s * b : (s + 1) * b], y[s * b : (s + 1) * b], C, LR)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = {"clipped": int((norms0 > C).sum()), "n": len(norms0)}
    ours, counts, opt_name = _train(
        PrivacyEngine(), copy.deepcopy(base), x, y, rank, world, C, 2, 0.0, 1
    )
    up, up_counts, up_name = _train(
        opacus.PrivacyEngine(), copy.deepcopy(base), x, y, rank, world, C, 2, 0.0, 1
    )
    out.update(
        ours_vs_loop=_max_diff(ours, ref_params),
        ours_vs_upstream=_max_diff(ours, up),
        counts=counts,
        upstream_counts=up_counts,
        opt=opt_name,
        upstream_opt=up_name,
    )
    # Noise on: every rank adds rank 0's draw; equals one process on the global batch, same seed.
    noisy, _, _ = _train(PrivacyEngine(), copy.deepcopy(base), x, y, rank, world, C, 2, 1.0, 5)
    noisy_drawn_ahead = sum(_train.drawn_ahead)
    single, _, _ = _train(
        opacus.PrivacyEngine(),
        copy.deepcopy(base),
        x,
        y,
        rank,
        world,
        C,
        2,
        1.0,
        5,
        local=False,
        wrap=None,
    )
    out["noisy_vs_single"] = _max_diff(noisy, single)
    out["noisy_drawn_ahead"] = noisy_drawn_ahead
    out["noisy_moved"] = _max_diff(noisy, ours)
    # DPDDP: no reducer, upstream's optimizer all-reduces once; ours leaves it as it is.
    dp, dp_counts, dp_name = _train(
        PrivacyEngine(), copy.deepcopy(base), x, y, rank, world, C, 2, 0.0, 1, wrap=DPDDP
    )
    out.update(dpddp_vs_loop=_max_diff(dp, ref_params), dpddp_opt=dp_name)
    return out


def ddp_tied_llama(rank: int, world: int) -> dict:
    """A tied tiny Llama under DDP with our engine equals the clip-each-sample loop."""
    from opacus_fsdp_sync.models import LlamaSpec, build_llama
    from tests.workers_tied import llama_sample_loss

    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=True))
    b = B_LOCAL * world
    ids = torch.randint(
        1, base.config.vocab_size, (2 * b, 10), generator=torch.Generator().manual_seed(1)
    )
    _, norms = per_sample_clipped_grads(
        copy.deepcopy(base), llama_sample_loss, ids[:b], ids[:b], 1.0
    )
    C = norms.median().item()
    ref = copy.deepcopy(base)
    for s in range(2):
        x = ids[s * b : (s + 1) * b]
        clip_each_sample_step(ref, llama_sample_loss, x, x, C, LR)
    model = DDP(copy.deepcopy(base))
    engine = PrivacyEngine()
    gsm, opt, crit, _ = make_private(engine, model, (ids,), b, C, "ghost", lr=LR)
    for s in range(2):
        x = ids[s * b : (s + 1) * b][rank * B_LOCAL : (rank + 1) * B_LOCAL]
        lm_loss(gsm, crit, x).backward()
        opt.step()
        opt.zero_grad()
    got = {n: p.detach() for n, p in model.module.named_parameters()}
    return {
        "vs_loop": _max_diff(got, {n: p.detach() for n, p in ref.named_parameters()}),
        "clipped": int((norms > C).sum()),
        "n": len(norms),
        "opt": type(opt).__name__,
        "one_backward": engine.one_backward,
    }


def ddp_no_sync_refused(rank: int, world: int) -> str:
    """The user's no_sync() accumulation is refused (the swapped optimizer would not reduce)."""
    torch.manual_seed(0)
    x, y = _token_data(world, 1)
    model = DDP(EmbedNet())
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(), model, (x, y), B_LOCAL * world, 1.0, "ghost", lr=LR
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    try:
        with model.no_sync():
            crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"
