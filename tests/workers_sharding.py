"""Rank functions for the sharding config: strategies x wrap policies, tied, AC, checkpoints."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.tensor import DTensor

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine, phase
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import (
    ShardingConfig,
    load_checkpoint,
    save_checkpoint,
    shard_model,
)
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import lm_loss, make_private
from tests.workers_tied import llama_sample_loss

warnings.filterwarnings("ignore")
B_LOCAL, T, LR = 2, 10, 0.5


def _ids(world, vocab, steps=1):
    g = torch.Generator().manual_seed(7)
    return torch.randint(1, vocab, (B_LOCAL * world * steps, T), generator=g)


def _full(model):
    out = {}
    for n, p in model.named_parameters():
        n = n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
    return out


def _diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _private_step(model, ids, rank, world, C):
    b = B_LOCAL * world
    gsm, opt, crit, _ = make_private(PrivacyEngine(), model, (ids,), b, C, "ghost_fsdp", lr=LR)
    x = ids[rank * B_LOCAL : (rank + 1) * B_LOCAL]
    with CollectiveCounter() as counter:
        with phase("forward"):
            loss = lm_loss(gsm, crit, x)
        loss.backward()
        with phase("optimizer_step"):
            opt.step()
    collectives = sum(k["count"] for p in counter.as_dict().values() for k in p.values())
    return collectives


def strategies_and_policies(rank: int, world: int, combos: list, tie: bool = False) -> dict:
    """For each (strategy, wrap policy, replicate degree): one DP step vs the loop."""
    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=tie))
    ids = _ids(world, base.config.vocab_size)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), llama_sample_loss, ids, ids, 1.0)
    C = norms.median().item()
    ref = copy.deepcopy(base)
    clip_each_sample_step(ref, llama_sample_loss, ids, ids, C, LR)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = {"clipped": int((norms > C).sum()), "n": len(norms), "results": {}}
    for strategy, policy, replicas, ac in combos:
        model = copy.deepcopy(base)
        cfg = ShardingConfig(
            strategy=strategy,
            wrap_policy=policy,
            replicate_degree=replicas,
            min_num_params=5000,
            activation_checkpointing=ac,
        )
        model = shard_model(model, cfg, device=torch.device("cpu"))
        collectives = _private_step(model, ids, rank, world, C)
        out["results"][f"{strategy}/{policy}/{replicas}/{'ac' if ac else 'noac'}"] = {
            "vs_loop": _diff(_full(model), ref_params),
            "collectives": collectives,
        }
    return out


def _adam_private(model, ids, world):
    b = B_LOCAL * world
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return make_private(PrivacyEngine(), model, (ids,), b, 1.0, "ghost_fsdp", optimizer=optimizer)


def _adam_step(gsm, opt, crit, ids, rank, world, s):
    b = B_LOCAL * world
    x = ids[s * b : (s + 1) * b][rank * B_LOCAL : (rank + 1) * B_LOCAL]
    lm_loss(gsm, crit, x).backward()
    opt.step()
    opt.zero_grad()


def checkpoint_save(rank: int, world: int, path: str) -> dict:
    """Two private Adam steps, save, return the full state, then a third step's parameters."""
    torch.manual_seed(0)
    model = shard_model(
        build_llama(LlamaSpec(preset="tiny")), ShardingConfig(), device=torch.device("cpu")
    )
    ids = _ids(world, model.config.vocab_size, steps=3)
    gsm, opt, crit, _ = _adam_private(model, ids, world)
    for s in range(2):
        _adam_step(gsm, opt, crit, ids, rank, world, s)
    save_checkpoint(path, gsm, opt)
    out = {"params": _full(model), "exp_avg": _exp_avg(model, opt)}
    _adam_step(gsm, opt, crit, ids, rank, world, 2)
    out["after_step3"] = _full(model)
    return out


def _exp_avg(model, opt):
    inner = getattr(opt, "original_optimizer", opt)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in inner.state.items():
        t = st["exp_avg"]
        out[names[id(p)]] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def checkpoint_load(rank: int, world: int, path: str, data_world: int) -> dict:
    """Loads at this world size; with the saving world size, also runs the third step."""
    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model = shard_model(
        build_llama(LlamaSpec(preset="tiny")), ShardingConfig(), device=torch.device("cpu")
    )
    ids = _ids(data_world, model.config.vocab_size, steps=3)
    gsm, opt, crit, _ = _adam_private(model, ids, world)
    load_checkpoint(path, gsm, opt)
    out = {"params": _full(model), "exp_avg": _exp_avg(model, opt)}
    if world == data_world:
        _adam_step(gsm, opt, crit, ids, rank, world, 2)
        out["after_step3"] = _full(model)
    return out


def fsdp1_backend(rank: int, world: int) -> dict:
    """FSDP1 from the same config: a non-private SGD step equals one process; ghost works."""
    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny"))
    ids = _ids(world, base.config.vocab_size)
    ref = copy.deepcopy(base)
    torch.optim.SGD(ref.parameters(), lr=LR).zero_grad()
    llama_sample_loss(ref, ids, ids).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = {}
    for strategy, replicas in (
        ("full", None),
        ("shard_grad_op", None),
        ("no_shard", None),
        ("hybrid_full", world),
    ):
        cfg = ShardingConfig(backend="fsdp1", strategy=strategy, replicate_degree=replicas)
        model = shard_model(copy.deepcopy(base), cfg, device=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x = ids[rank * B_LOCAL : (rank + 1) * B_LOCAL]
        llama_sample_loss(model, x, x).backward()
        opt.step()
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            out[strategy] = _diff(_full(model), ref_params)
    model = shard_model(
        copy.deepcopy(base), ShardingConfig(backend="fsdp1"), device=torch.device("cpu")
    )
    try:
        _private_step(model, ids, rank, world, 1.0)
        out["ghost"] = "no error"
    except Exception as err:  # noqa: BLE001 - the message is the result
        out["ghost"] = f"{type(err).__name__}: {err}"
    return out
