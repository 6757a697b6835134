"""Rank functions for gradient access: microbatches, norms, and seed 002's loop on every API."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from opacus_fsdp_sync.grad_access import (
    add_grads,
    clean_name,
    freeze_outside,
    full_grads,
    layer_grad_norms,
    load_grads,
    local_grads,
    microbatch,
    same_sign_filter,
    save_grads,
    unsynced_grads,
)
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model

warnings.filterwarnings("ignore")
APIS = ("fsdp2", "fsdp1", "ddp", "single")
B, T, K, LR, ALPHA = 2, 8, 2, 0.1, 0.5
LAYERS = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
TARGET = "model.layers.1"


def base_model():
    torch.manual_seed(0)
    return build_llama(LlamaSpec(preset="tiny"))


def batches(world: int, vocab: int) -> torch.Tensor:
    """(world, K + 3, B, T) token ids: K microbatches, a synced one, retain and forget."""
    g = torch.Generator().manual_seed(123)
    return torch.randint(1, vocab, (world, K + 3, B, T), generator=g)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def wrap(api: str, model):
    cpu = torch.device("cpu")
    if api in ("fsdp2", "fsdp1"):
        return shard_model(model, ShardingConfig(backend=api), device=cpu)
    if api == "ddp":
        return DistributedDataParallel(model)
    return model


def ref_grads(base, ids_list, scale=1.0):
    """Single-process gradients of ``scale * sum(losses)`` on a copy of ``base``."""
    model = copy.deepcopy(base)
    total = sum(loss_of(model, ids) for ids in ids_list) * scale
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def full_params(model, api):
    if api == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    if api == "ddp":
        model = model.module
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def max_diff(got: dict, want: dict) -> float:
    if got.keys() != want.keys() or any(got[k].shape != want[k].shape for k in want):
        return float("inf")  # missing or misshapen gradients fail the check in the parent
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def ref_norms(grads: dict) -> dict:
    def norm(names):
        return torch.sqrt(sum(grads[n].double().pow(2).sum() for n in names)).item()

    out = {p: norm([n for n in grads if n.startswith(p + ".")]) for p in LAYERS}
    out["total"] = norm(list(grads))
    return out


def _check_microbatches(api, rank, world, base, ids) -> dict:
    """Each microbatch alone, the running sum kept for training, then the synced step."""
    model = wrap(api, copy.deepcopy(base))
    ranks = range(world) if api != "single" else [rank]
    res = {"mb": [], "sum": [], "control": []}
    for k in range(K):
        with microbatch(model) as mb:
            loss_of(model, ids[rank, k]).backward()
        want = ref_grads(base, [ids[rank, k]])
        res["mb"].append(max_diff(mb.grads, want))
        acc = ref_grads(base, [ids[rank, j] for j in range(k + 1)])
        res["sum"].append(max_diff(unsynced_grads(model), acc))
        if k:  # the running sum is not the microbatch: the check above can fail
            res["control"].append(max_diff(unsynced_grads(model), want))
    loss_of(model, ids[rank, K]).backward()  # synced: reduces all microbatches together
    want = ref_grads(base, [ids[r, j] for r in ranks for j in range(K + 1)], 1 / len(ranks))
    res["synced"] = max_diff(full_grads(model), want)
    local = local_grads(model)
    res["sharded"] = sum(g.numel() for g in local.values()) < sum(g.numel() for g in want.values())
    norms = layer_grad_norms(model, LAYERS)
    got = dict(norms.per_layer, total=norms.total)
    expected = ref_norms(want)
    res["norms"] = max(abs(got[k] - expected[k]) / expected[k] for k in expected)
    default = layer_grad_norms(model)
    res["default_layers"] = sorted(default.per_layer)
    res["default_total"] = abs(default.total - expected["total"]) / expected["total"]
    local_total = sum(g.double().pow(2).sum() for g in local.values()).sqrt().item()
    res["norm_control"] = abs(local_total - expected["total"]) / expected["total"]
    return res


def _seed002_reference(base, ids, ranks, freeze=True):
    """Seed 002's loop with plain ``param.grad`` on one device (the reference)."""
    model = copy.deepcopy(base)
    scale = 1 / len(ranks)
    retain = ref_grads(base, [ids[r, K + 1] for r in ranks], scale)
    forget = ref_grads(base, [ids[r, K + 2] for r in ranks], -scale)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.where(torch.sign(forget[name]) == torch.sign(retain[name]), forget[name], 0)
            g = g + ALPHA * retain[name]
            if freeze and not name.startswith(TARGET + "."):
                g = torch.zeros_like(g)
            p -= LR * g
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_seed002(api, rank, world, base, ids) -> dict:
    """Retain/forget backward, save, sign filter, weighted combine, freeze, SGD step."""
    model = wrap(api, copy.deepcopy(base))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    loss_of(model, ids[rank, K + 1]).backward()
    retain = save_grads(model)
    retain_norm = layer_grad_norms(model, TARGET).per_layer[TARGET]
    opt.zero_grad()
    (-loss_of(model, ids[rank, K + 2])).backward()
    forget = save_grads(model)
    load_grads(model, same_sign_filter(forget, retain))
    add_grads(model, retain, weight=ALPHA)
    frozen = freeze_outside(model, [TARGET])
    opt.step()
    got = full_params(model, api)
    ranks = range(world) if api != "single" else [rank]
    want = _seed002_reference(base, ids, ranks)
    unfrozen = _seed002_reference(base, ids, ranks, freeze=False)
    ref_retain = ref_grads(base, [ids[r, K + 1] for r in ranks], 1 / len(ranks))
    want_norm = ref_norms(ref_retain)[TARGET]
    return {
        "params": max_diff(got, want),
        "control": max_diff(got, unfrozen),
        "frozen": frozen,
        "n_params": len(want),
        "retain_norm": abs(retain_norm - want_norm) / want_norm,
    }


def _check_errors(api, base) -> dict:
    """Clear errors for bad input, on the wrapped model."""
    model = wrap(api, copy.deepcopy(base))
    loss_of(model, torch.ones(1, 4, dtype=torch.long)).backward()
    out = {}
    for label, call in (
        ("prefix", lambda: freeze_outside(model, ["model.layer.0"])),
        ("weight", lambda: add_grads(model, save_grads(model), weight=float("nan"))),
    ):
        try:
            call()
            out[label] = "no error"
        except ValueError as err:
            out[label] = str(err)
    return out


def all_checks(rank: int, world: int, apis: tuple = APIS) -> dict:
    """Every check on every API, in one spawn."""
    base = base_model()
    ids = batches(world, base.config.vocab_size)
    out = {}
    for api in apis:
        out[api] = {
            "microbatch": _check_microbatches(api, rank, world, base, ids),
            "seed002": _check_seed002(api, rank, world, base, ids),
            "errors": _check_errors(api, base),
        }
        dist.barrier()
    return out
