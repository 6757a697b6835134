"""Rank functions for ghost clipping under FSDP1 (use_orig_params=True)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine, phase
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import make_private
from tests.workers_tied import llama_sample_loss

warnings.filterwarnings("ignore")
B_LOCAL, T, LR = 2, 10, 0.5


def llama_and_loop(world: int, steps: int, tie: bool = False):
    """A tiny Llama, its token batches, the median-norm clip bound and the clip-each-sample loop.

    Returns:
        ``(base, ids, first-batch per-sample norms, C, loop parameters after ``steps`` steps)``.
    """
    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=tie))
    b = B_LOCAL * world
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, base.config.vocab_size, (b * steps, T), generator=g)
    _, norms = per_sample_clipped_grads(
        copy.deepcopy(base), llama_sample_loss, ids[:b], ids[:b], 1.0
    )
    C = norms.median().item()
    ref = copy.deepcopy(base)
    for s in range(steps):
        x = ids[s * b : (s + 1) * b]
        clip_each_sample_step(ref, llama_sample_loss, x, x, C, LR)
    return base, ids, norms, C, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _full(model):
    with FSDP.summon_full_params(model):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().float().clone()
            for n, p in model.named_parameters()
        }


def _diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def fsdp1_exactness(
    rank: int,
    world: int,
    strategies: list,
    steps: int = 2,
    tie=False,
    precision="fp32",
    noise=0.0,
    one_backward=True,
) -> dict:
    base, ids, norms, C, ref_params = llama_and_loop(world, steps, tie)
    b = B_LOCAL * world
    out = {"clipped": int((norms > C).sum()), "n": len(norms), "results": {}}
    for strategy in strategies:
        cfg = ShardingConfig.for_precision(precision, backend="fsdp1", strategy=strategy)
        model = shard_model(copy.deepcopy(base), cfg, device=torch.device("cpu"))
        engine = PrivacyEngine(one_backward=one_backward)
        gsm, opt, crit, _ = make_private(
            engine,
            model,
            (ids,),
            b,
            C,
            "ghost_fsdp",
            noise=noise,
            lr=LR,
        )
        counts = []
        for s in range(steps):
            x = ids[s * b : (s + 1) * b][rank * B_LOCAL : (rank + 1) * B_LOCAL]
            with CollectiveCounter() as counter:
                with phase("forward"):
                    logits = gsm(input_ids=x).logits[:, :-1]
                loss = crit(
                    logits.reshape(-1, logits.shape[-1]),
                    x[:, 1:].reshape(-1),
                    shape=logits.shape[:2],
                )
                loss.backward()
                with phase("optimizer_step"):
                    opt.step()
                    opt.zero_grad()
            counts.append(counter.as_dict())
        out["results"][strategy] = {
            "vs_loop": _diff(_full(model), ref_params),
            "counts": counts,
            "optimizer": type(opt).__name__,
            "one_backward": engine.one_backward,
        }
    return out


def fsdp1_refusals(rank: int, world: int) -> dict:
    """What FSDP1 ghost clipping cannot do is refused at make_private, with a message."""
    from opacus_fsdp_sync import UnsupportedConfigurationError

    out = {}
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (4 * world, T))
    cases = {
        "hybrid": (ShardingConfig(backend="fsdp1", strategy="hybrid_full", replicate_degree=1), {}),
        "upstream_passes": (ShardingConfig(backend="fsdp1"), {"sync_optimization": False}),
    }
    flat = FSDP(
        build_llama(LlamaSpec(preset="tiny")), device_id=torch.device("cpu"), use_orig_params=False
    )
    two_roots = build_llama(LlamaSpec(preset="tiny"))
    for i, layer in enumerate(two_roots.model.layers):
        two_roots.model.layers[i] = FSDP(layer, device_id=torch.device("cpu"), use_orig_params=True)
    built = {"flat_params": flat, "two_roots": two_roots}
    for name, (cfg, opts) in [*cases.items(), *((k, (None, {})) for k in built)]:
        if cfg is None:
            model = built[name]
        else:
            model = shard_model(
                build_llama(LlamaSpec(preset="tiny")), cfg, device=torch.device("cpu")
            )
        try:
            make_private(PrivacyEngine(**opts), model, (ids,), 4 * world, 1.0, "ghost_fsdp", lr=LR)
            out[name] = "no error"
        except UnsupportedConfigurationError as err:
            out[name] = str(err)
    return out
