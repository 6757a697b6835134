"""Rank functions for the lean hook lanes: lanes on against the full chain of mixin hooks."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.tensor import DTensor

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.hooks.lean import LeanLaneMixin
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.workers_tied import B_LOCAL, LR, T, _train, llama_sample_loss

warnings.filterwarnings("ignore")


def _counting_lanes():
    """Wraps the lane's output-gradient hook with a call counter (returned)."""
    calls = {"n": 0}
    original = LeanLaneMixin.lean_output_grad

    def counted(self, module, grad):
        if self.lean_hooks and self.hooks_enabled:
            calls["n"] += 1
        return original(self, module, grad)

    LeanLaneMixin.lean_output_grad = counted
    return calls


def _full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def lanes_against_chain(rank: int, world: int, tie: bool, engine_kwargs: dict) -> dict:
    """Two FSDP2 steps of a tiny Llama with the lanes on and off, and the clip-each-sample loop.

    Returns the largest difference between lanes on and off (parameters after each step and
    per-sample norms), each against the loop, the lane layer types and the lane calls per step.
    """
    steps = 2
    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=tie))
    b = B_LOCAL * world
    ids = torch.randint(
        1, base.config.vocab_size, (b * steps, T), generator=torch.Generator().manual_seed(1)
    )
    _, norms0 = per_sample_clipped_grads(
        copy.deepcopy(base), llama_sample_loss, ids[:b], ids[:b], 1.0
    )
    C = norms0.median().item()
    ref, ref_norms, ref_params = copy.deepcopy(base), [], []
    for s in range(steps):
        x = ids[s * b : (s + 1) * b]
        ref_norms.append(clip_each_sample_step(ref, llama_sample_loss, x, x, C, LR).tolist())
        ref_params.append(_full(ref))
    calls = _counting_lanes()
    on_params, on_norms = _train(
        PrivacyEngine(**engine_kwargs), base, ids, rank, world, C, steps, True
    )
    gsm = _train.last_gsm
    lane_types = sorted({lane.layer_type.__name__ for lane in gsm._lanes.values()})
    lane_calls = calls["n"]
    LeanLaneMixin.lean_hooks = False
    try:
        off_params, off_norms = _train(
            PrivacyEngine(**engine_kwargs), base, ids, rank, world, C, steps, True
        )
        off_calls = calls["n"] - lane_calls
    finally:
        LeanLaneMixin.lean_hooks = True

    def diff(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return dict(
        C=C,
        ref_norms=ref_norms,
        on_vs_off=[diff(p, q) for p, q in zip(on_params, off_params)],
        norms_on_vs_off=max(abs(x - y) for s, t in zip(on_norms, off_norms) for x, y in zip(s, t)),
        on_vs_loop=[diff(p, r) for p, r in zip(on_params, ref_params)],
        on_norms=on_norms,
        lane_types=lane_types,
        lanes=len(gsm._lanes),
        hooked=len(gsm._hooked),
        lane_calls=lane_calls,
        off_calls=off_calls,
    )
