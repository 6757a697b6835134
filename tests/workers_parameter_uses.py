"""Rank functions for the parameter-use check under FSDP1 (use_orig_params=True)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers.ownership import ParameterUseError
from opacus_fsdp_sync.testing import per_sample_clipped_grads
from tests.private import make_private

warnings.filterwarnings("ignore")
V, T, B_LOCAL = 20, 6, 2
#: Clip bound far under every per-sample norm (checked): clipping is active for each sample.
C = 1e-3
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


class OddSibling(nn.Module):
    """A sibling's weight read without calling it, behind parameters of odd sizes.

    The odd sizes put FSDP1's alignment padding between the flat parameter's pieces, so the
    read's split index (4) is not its parameter index (2).
    """

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.h = nn.Embedding(V, 7), nn.Linear(7, 5)
        self.proj, self.o = nn.Linear(5, 5, bias=False), nn.Linear(5, V)

    def forward(self, x):
        return self.o(torch.tanh(nn.functional.linear(self.h(self.wte(x)), self.proj.weight)))


class OddFunctionalHead(nn.Module):
    """nanoGPT's head: the embedding's weight reused through ``F.linear``, after odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.h, self.wte = nn.Linear(7, 7), nn.Embedding(V, 7)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.h(self.wte(x))), self.wte.weight)


class LateBias(nn.Module):
    """A later unit's bias read before that unit runs (NO_SHARD: the original parameter itself),
    beside a trainable weight with transposed storage (FSDP1 views it with ``as_strided``)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.h = nn.Embedding(V, 8), nn.Linear(8, 8)
        self.h.weight = nn.Parameter(torch.randn(8, 8).t().contiguous().t())
        self.late, self.o = nn.Linear(8, 8), nn.Linear(8, V)

    def forward(self, x):
        return self.o(torch.tanh(self.late(self.h(self.wte(x)) + self.late.bias)))


class Transposed(OddSibling):
    """A supported model (every read hooked) whose trainable weight has transposed storage."""

    def __init__(self) -> None:
        super().__init__()
        self.proj.weight = nn.Parameter(torch.randn(5, 5).t().contiguous().t())

    def forward(self, x):
        return self.o(torch.tanh(self.proj(self.h(self.wte(x)))))


def _sample_loss(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def _case(rank, world, cls, strategy, options, frozen):
    torch.manual_seed(0)
    base = cls().double()
    if frozen:
        base.proj.weight.requires_grad_(False)  # a frozen weight read anyhow: no use to check
    b = B_LOCAL * world
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)
    ref, norms = per_sample_clipped_grads(copy.deepcopy(base), _sample_loss, x, y, C)
    unit = {
        "device_id": torch.device("cpu"),
        "use_orig_params": True,
        "sharding_strategy": getattr(ShardingStrategy, strategy),
    }
    model = copy.deepcopy(base)
    if cls is LateBias:  # a unit of its own inside the root's
        model.late = FSDP(model.late, **unit)
    model = FSDP(model, **unit)
    params = [p for p in model.parameters() if p.requires_grad]
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(**options),
        model,
        (x, y),
        b,
        C,
        "ghost_fsdp",
        optimizer=torch.optim.SGD(params, lr=1.0),
    )
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    loss = crit(gsm(x[rows]).reshape(-1, V), y[rows].reshape(-1), shape=(B_LOCAL, T))
    try:
        loss.backward()
    except ParameterUseError as err:
        return {"error": str(err), "grads_left": any(p.grad is not None for p in params)}
    opt.step()
    with FSDP.summon_full_params(model):
        got = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach() for n, p in model.named_parameters()
        }
        want = {n: p.detach() - ref.get(n, 0.0) for n, p in base.named_parameters()}
        return {
            "vs_loop": max(float((got[n] - want[n]).abs().max()) for n in want),
            "update": max(float(r.abs().max()) for r in ref.values()),
            "clipped": bool((norms > C).all()),
        }


def fsdp1_uses(rank: int, world: int) -> dict:
    """Each model, strategy and path: the check's error, or the step against the loop."""
    out = {}
    models = {"sibling": OddSibling, "functional_head": OddFunctionalHead, "transposed": Transposed}
    for strategy in STRATEGIES:
        for path, options in (("one", {}), ("two_pass", {"one_backward": False})):
            for name, cls in models.items():
                if cls is Transposed and strategy == "NO_SHARD":
                    continue  # FSDP1 NO_SHARD steps such a weight wrong without DP too (torch)
                out[(name, strategy, path)] = _case(rank, world, cls, strategy, options, False)
            out[("frozen_sibling", strategy, path)] = _case(
                rank, world, OddSibling, strategy, options, True
            )
    # sharded, a unit's parameter cannot be read before its forward at all (FSDP1 fails)
    for path, options in (("one", {}), ("two_pass", {"one_backward": False})):
        out[("late_bias", "NO_SHARD", path)] = _case(
            rank, world, LateBias, "NO_SHARD", options, False
        )
    return out
