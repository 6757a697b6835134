"""Rank functions for the one-backward step under FSDP1 (use_orig_params=True)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine, phase
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from tests.private import capture_ghost_log, lm_loss, make_private
from tests.workers_fsdp1 import _diff, _full, llama_and_loop
from tests.workers_tied import llama_sample_loss

warnings.filterwarnings("ignore")
B_LOCAL, T, LR = 2, 10, 0.5


def _counts(counter: CollectiveCounter) -> dict:
    """``{phase: {kind: count}}`` of one step."""
    return {p: {k: s["count"] for k, s in kinds.items()} for p, kinds in counter.as_dict().items()}


def _shard(base: nn.Module, strategy: str, precision: str = "fp32") -> nn.Module:
    cfg = ShardingConfig.for_precision(precision, backend="fsdp1", strategy=strategy)
    return shard_model(copy.deepcopy(base), cfg, device=torch.device("cpu"))


def _local(ids, s, b, rank):
    return ids[s * b : (s + 1) * b][rank * B_LOCAL : (rank + 1) * B_LOCAL]


def _non_private(base, ids, rank, world, strategy, steps) -> list[dict]:
    """Collectives per step of a plain FSDP1 step (forward, backward, SGD step)."""
    model = _shard(base, strategy)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    b, counts = B_LOCAL * world, []
    for s in range(steps):
        x = _local(ids, s, b, rank)
        with CollectiveCounter() as counter:
            llama_sample_loss(model, x, x).backward()
            opt.step()
            opt.zero_grad()
        counts.append(_counts(counter))
    return counts


def _private(base, ids, rank, world, strategy, steps, C, noise, one, precision) -> dict:
    model = _shard(base, strategy, precision)
    engine = PrivacyEngine(one_backward=one)
    gen = torch.Generator().manual_seed(11)
    b = B_LOCAL * world
    gsm, opt, crit, _ = make_private(
        engine, model, (ids,), b, C, "ghost_fsdp", noise=noise, lr=LR, noise_generator=gen
    )
    counts, norms = [], []
    for s in range(steps):
        with CollectiveCounter() as counter:
            with phase("forward"):
                loss = lm_loss(gsm, crit, _local(ids, s, b, rank))
            loss.backward()
            norms.extend(gsm.per_sample_gradient_norms.detach().float().tolist())
            with phase("optimizer_step"):
                opt.step()
                opt.zero_grad()
        counts.append(_counts(counter))
    return {"params": _full(model), "counts": counts, "used": engine.one_backward, "norms": norms}


def one_vs_two(
    rank: int,
    world: int,
    strategies: list,
    steps: int = 3,
    noise: float = 0.0,
    precision: str = "fp32",
):
    """Per strategy: one backward against two passes, the loop, and the non-private counts."""
    records = capture_ghost_log()
    base, ids, norms, C, loop = llama_and_loop(world, steps)
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    out = {"C": C, "clipped": int((norms > C).sum()), "n": len(norms), "results": {}}
    for strategy in strategies:
        one = _private(base, ids, rank, world, strategy, steps, C, noise, True, precision)
        two = _private(base, ids, rank, world, strategy, steps, C, noise, False, precision)
        out["results"][strategy] = {
            "one_vs_two": _diff(one["params"], two["params"]),
            "one_vs_loop": _diff(one["params"], loop),
            "two_vs_loop": _diff(two["params"], loop),
            "moved": _diff(one["params"], start),
            "used_one": one["used"],
            "used_two": two["used"],
            "norms": one["norms"],
            "counts_one": one["counts"],
            "counts_two": two["counts"],
            "counts_plain": _non_private(base, ids, rank, world, strategy, steps),
        }
    out["records"] = [r for r in records if r.startswith("[Ghost] step:")]
    return out


def unsynced_microbatch_is_refused(rank: int, world: int, strategy: str) -> dict:
    """The user's own FSDP1 accumulation (``no_sync()``) is refused; the next step is exact."""
    from opacus_fsdp_sync.distributed import UnsupportedConfigurationError

    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny"))
    b = B_LOCAL * world
    ids = torch.randint(1, base.config.vocab_size, (2 * b, T), generator=torch.Generator())
    out = {"refused": {}}
    for one in (True, False):
        model = _shard(base, strategy)
        engine = PrivacyEngine(one_backward=one)
        gsm, opt, crit, _ = make_private(engine, model, (ids,), b, 0.5, "ghost_fsdp", lr=LR)
        try:
            with model.no_sync():
                lm_loss(gsm, crit, _local(ids, 0, b, rank)).backward()
            out["refused"][one] = ""
        except UnsupportedConfigurationError as err:
            out["refused"][one] = str(err)
        opt.zero_grad()
        lm_loss(gsm, crit, _local(ids, 1, b, rank)).backward()
        opt.step()
        out[one] = _full(model)
    clean = _shard(base, strategy)
    gsm, opt, crit, _ = make_private(PrivacyEngine(), clean, (ids,), b, 0.5, "ghost_fsdp", lr=LR)
    lm_loss(gsm, crit, _local(ids, 1, b, rank)).backward()
    opt.step()
    start = {n: p.detach().float() for n, p in base.named_parameters()}
    return {
        "refused": out["refused"],
        "after_vs_clean": max(_diff(out[True], _full(clean)), _diff(out[False], _full(clean))),
        "moved": _diff(out[True], start),
    }
