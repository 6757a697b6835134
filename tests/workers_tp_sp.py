"""Rank functions for what sequence parallelism refuses (TP alone, 2 gloo ranks).

Each case builds :class:`tests.workers_tp.SPNet` under a variant of its sequence-parallel plan
and runs one private step on a fixed batch (Poisson sampling off): the refusal message, where it
came (``forward`` or ``backward``) and whether any parameter had a gradient by then.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from opacus_fsdp_sync import PrivacyEngine
from tests.workers_tp import CLIP, D, base, dataset, sp_plan

warnings.filterwarnings("ignore")


def _variant(case: str, model: nn.Module, plan: dict) -> None:
    """Changes ``model`` and ``plan`` for ``case`` (see :func:`sp_refusals`)."""
    if case == "plain_head":
        del plan["l3"]
    elif case == "layernorm":
        model.norm = nn.LayerNorm(D)
        plan["norm"] = SequenceParallel()
    elif case == "plain_layernorm":  # out of the plan, fed this rank's tokens as a plain tensor
        model.norm = nn.LayerNorm(D)
        del plan["norm"]


def _attempt(model: nn.Module, x: torch.Tensor, y: torch.Tensor, even: int = 0) -> dict | None:
    """One private step (after one on ``even`` tokens, if given); None when it went through,
    else where and what it raised."""
    from tests.private import make_private

    gsm, opt, crit, _ = make_private(
        PrivacyEngine(), model, (x, y), len(x), CLIP["sp"], "ghost_fsdp"
    )
    if even:
        crit(gsm(dataset().tensors[0][: len(x), :even]), y).backward()
        opt.step()
        for p in model.parameters():
            p.grad = None
    phase = "forward"
    try:
        out = gsm(x)
        phase = "backward"
        crit(out, y).backward()
        opt.step()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        graded = [n for n, p in model.named_parameters() if p.grad is not None]
        return {"message": f"{type(err).__name__}: {err}", "phase": phase, "graded": graded}
    return None


def sp_refusals(rank: int, world: int) -> dict:
    """What sequence parallelism refuses: each case's :func:`_attempt` result.

    ``plain_head``: ``l3`` left out of the plan, fed this rank's tokens as a plain tensor;
    ``layernorm``: ``SequenceParallel`` on an ``nn.LayerNorm`` (Opacus's norm, not summed over
    tp); ``plain_layernorm``: a trainable ``nn.LayerNorm`` left out of the plan and fed this
    rank's tokens as a plain tensor; ``uneven``: the plan as it is, on a sequence of 3 tokens
    (the tp degree 2 does not divide it); ``uneven_later``: the same after a step on 4 tokens
    (refused before the forward starts).
    """
    out = {}
    x, y = dataset().tensors
    for case in ("plain_head", "layernorm", "plain_layernorm", "uneven", "uneven_later"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model, plan = base("sp"), sp_plan()
        _variant(case, model, plan)
        parallelize_module(model, mesh, plan)
        xb = x[:4, :3] if case.startswith("uneven") else x[:4]
        out[case] = _attempt(model, xb, y[:4], even=4 if case == "uneven_later" else 0)
    return out


def ghost_tp(rank: int, world: int) -> dict:
    """One step of :class:`tests.workers_tp.SPNet` under its sequence-parallel plan with
    ``grad_sample_mode="ghost_tp"`` (upstream's name), against the loop."""
    import copy

    from opacus_fsdp_sync.testing import clip_each_sample_step
    from tests.private import make_private
    from tests.workers_tp import LR, _full, sample_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = base("sp")
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, sp_plan())
    x, y = (t[:4] for t in dataset().tensors)
    engine = PrivacyEngine()
    gsm, opt, crit, _ = make_private(engine, model, (x, y), 4, CLIP["sp"], "ghost_tp", lr=LR)
    crit(gsm(x), y).backward()
    opt.step()
    norms = clip_each_sample_step(ref, sample_loss, x, y, CLIP["sp"], LR)
    full = _full(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    clipped = int((norms > CLIP["sp"]).sum())
    return {"diff": diff, "api": engine.distributed_api, "clipped": clipped}
