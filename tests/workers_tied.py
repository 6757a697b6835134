"""Rank functions for tied-weight exactness under FSDP2 (and one device with world size 1)."""

from __future__ import annotations

import copy
import warnings

import opacus
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import lm_loss, make_private

warnings.filterwarnings("ignore")
LR = 0.5
B_LOCAL, T = 3, 12


def llama_sample_loss(model, x, _y):
    logits = model(input_ids=x).logits[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _train(engine, base, ids, rank, world, C, steps, fsdp, mixed_precision="fp32"):
    model = copy.deepcopy(base)
    if fsdp:
        cfg = ShardingConfig.for_precision(mixed_precision)
        model = shard_model(model, cfg, device=torch.device("cpu"))
    b = B_LOCAL * world
    mode = "ghost_fsdp" if fsdp else "ghost"
    gsm, opt, crit, _ = make_private(engine, model, (ids,), b, C, mode, lr=LR)
    _train.last_gsm = gsm
    params, norms = [], []
    for s in range(steps):
        x = ids[s * b : (s + 1) * b]
        if fsdp:
            x = x[rank * B_LOCAL : (rank + 1) * B_LOCAL]
        loss = lm_loss(gsm, crit, x)
        loss.backward()
        norms.append(gsm.per_sample_gradient_norms.detach().float().tolist())
        opt.step()
        opt.zero_grad()
        params.append(
            {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
                for n, p in model.named_parameters()
            }
        )
    return params, norms


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def tied_llama(rank: int, world: int, tie: bool = True, steps: int = 2) -> dict:
    """Ours (FSDP2 when world > 1... and one device) vs the clip-each-sample loop."""
    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=tie))
    V = base.config.vocab_size
    b = B_LOCAL * world
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (b * steps, T), generator=g)
    _, norms0 = per_sample_clipped_grads(
        copy.deepcopy(base), llama_sample_loss, ids[:b], ids[:b], 1.0
    )
    C = norms0.median().item()
    ref = copy.deepcopy(base)
    ref_norms, ref_params = [], []
    for s in range(steps):
        x = ids[s * b : (s + 1) * b]
        ref_norms.append(clip_each_sample_step(ref, llama_sample_loss, x, x, C, LR).tolist())
        ref_params.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    out = dict(
        C=C,
        ref_norms=ref_norms,
        tied=base.lm_head.weight is base.model.embed_tokens.weight,
        update=_diff(ref_params[-1], start),
    )
    # FSDP2 with per-sample gradients for every sequence Linear (the tied head included); the
    # one-device run below takes the ghost norms that "auto" picks for this tiny model.
    psg = PrivacyEngine(per_sample_grads=True)
    fsdp_p, fsdp_n = _train(psg, base, ids, rank, world, C, steps, fsdp=True)
    out["fsdp_vs_loop"] = [_diff(p, r) for p, r in zip(fsdp_p, ref_params)]
    policy = getattr(_train.last_gsm, "per_sample_policy", None)
    out["fsdp_per_sample_layers"] = policy.taken if policy is not None else 0
    out["fsdp_norms"] = fsdp_n
    # FSDP2 with ghost norms from the upper block triangle of the Grams (T = 12: rows 5 + 5 + 2).
    blocked = PrivacyEngine(per_sample_grads=False, gram_block=5)
    blk_p, blk_n = _train(blocked, base, ids, rank, world, C, steps, fsdp=True)
    out["blocked_vs_loop"] = [_diff(p, r) for p, r in zip(blk_p, ref_params)]
    out["blocked_norms"] = blk_n
    up_p, _ = _train(opacus.PrivacyEngine(), base, ids, rank, world, C, steps, fsdp=True)
    out["upstream_vs_loop"] = [_diff(p, r) for p, r in zip(up_p, ref_params)]
    if rank == 0:
        one_p, one_n = _train(PrivacyEngine(), base, ids, 0, world, C, steps, fsdp=False)
        out["single_vs_loop"] = [_diff(p, r) for p, r in zip(one_p, ref_params)]
        out["single_norms"] = one_n
    return out
