"""Rank functions for the lean hook lanes: lanes on against the full chain of mixin hooks."""

from __future__ import annotations

import copy
import warnings
from unittest import mock

import torch

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.hooks import lean
from opacus_fsdp_sync.hooks.lean import LeanLaneMixin
from opacus_fsdp_sync.layers.linear_norms import LinearNormSampler
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import lm_loss, make_private
from tests.workers_core import _full_params
from tests.workers_tied import B_LOCAL, LR, T, _diff, _train, llama_sample_loss

warnings.filterwarnings("ignore")


def _counting_lanes():
    """Counts the backward hooks that took the lane (its own use of Opacus's captured inputs)."""
    calls = {"n": 0}
    original = lean.take_captured

    def counted(module):
        calls["n"] += 1
        return original(module)

    lean.take_captured = counted
    return calls


def _counting_deferred():
    """Counts the norms the lanes deferred to the end of a first pass, and those batched."""
    calls = {"n": 0, "batched": 0, "tails": 0}
    original = LeanLaneMixin.finish_norms
    group = LinearNormSampler._finish_group

    def counted(self):
        calls["n"] += len(self._deferred)
        calls["tails"] += len(self._tails)
        return original(self)

    def grouped(self, jobs, scale):
        calls["batched"] += len(jobs)
        return group(self, jobs, scale)

    LeanLaneMixin.finish_norms = counted
    LinearNormSampler._finish_group = grouped
    return calls


def _left_state(gsm) -> list[str]:
    """Layers holding per-step state after a step (captured inputs, forward counts, batch size)."""
    left = []
    for m in gsm._hooked:
        state = m.__dict__
        if state.get("activations") or state.get("_forward_counter", 0) or "max_batch_len" in state:
            left.append(type(m).__name__)
    return left


def _eval_forward_captures_nothing(gsm, ids) -> bool:
    """An eval forward (no capture) and a forward with the hooks off leave no state."""
    gsm.eval()
    with torch.no_grad():
        gsm(ids)
    gsm.train()
    gsm.disable_hooks()
    try:
        gsm(ids)
    finally:
        gsm.enable_hooks()
    return not _left_state(gsm)


def _tiny_setup(world: int, steps: int, tie: bool = False):
    """A tiny Llama, the global batches of ``steps`` steps, and a clipping bound that clips
    about half of the first batch's samples (the median norm)."""
    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=tie))
    b = B_LOCAL * world
    ids = torch.randint(
        1, base.config.vocab_size, (b * steps, T), generator=torch.Generator().manual_seed(1)
    )
    _, norms0 = per_sample_clipped_grads(
        copy.deepcopy(base), llama_sample_loss, ids[:b], ids[:b], 1.0
    )
    return base, ids, norms0.median().item()


def lanes_against_chain(rank: int, world: int, tie: bool, engine_kwargs: dict) -> dict:
    """Two FSDP2 steps of a tiny Llama with the lanes on and off, and the clip-each-sample loop.

    Returns the largest difference between lanes on and off (parameters after each step and
    per-sample norms), each against the loop, the lane layer types and the lane calls per step.
    """
    steps = 2
    base, ids, C = _tiny_setup(world, steps, tie)
    b = B_LOCAL * world
    ref, ref_norms, ref_params = copy.deepcopy(base), [], []
    for s in range(steps):
        x = ids[s * b : (s + 1) * b]
        ref_norms.append(clip_each_sample_step(ref, llama_sample_loss, x, x, C, LR).tolist())
        ref_params.append(_full_params(ref))
    calls = _counting_lanes()
    deferred = _counting_deferred()
    on_params, on_norms = _train(
        PrivacyEngine(**engine_kwargs), base, ids, rank, world, C, steps, True
    )
    gsm = _train.last_gsm
    lane_types = sorted({lane.layer_type.__name__ for lane in gsm._lanes.values()})
    lane_calls = calls["n"]
    deferred_on, batched_on, tails_on = deferred["n"], deferred["batched"], deferred["tails"]
    left_on = _left_state(gsm) + (["deferred norms"] if gsm._deferred or gsm._tails else [])
    quiet = _eval_forward_captures_nothing(gsm, ids[rank * B_LOCAL : (rank + 1) * B_LOCAL])
    with mock.patch.object(LeanLaneMixin, "lean_hooks", False):
        off_params, off_norms = _train(
            PrivacyEngine(**engine_kwargs), base, ids, rank, world, C, steps, True
        )
        off_calls = calls["n"] - lane_calls
        left_off = _left_state(_train.last_gsm)
    with mock.patch.object(LeanLaneMixin, "defer_norms", False):  # each norm in its hook
        hook_params, hook_norms = _train(
            PrivacyEngine(**engine_kwargs), base, ids, rank, world, C, steps, True
        )
        deferred_off = deferred["n"] - deferred_on
        tails_off = deferred["tails"] - tails_on

    return dict(
        C=C,
        ref_norms=ref_norms,
        on_vs_off=[_diff(p, q) for p, q in zip(on_params, off_params)],
        norms_on_vs_off=max(abs(x - y) for s, t in zip(on_norms, off_norms) for x, y in zip(s, t)),
        on_vs_loop=[_diff(p, r) for p, r in zip(on_params, ref_params)],
        deferred_vs_hooks=[_diff(p, q) for p, q in zip(on_params, hook_params)],
        norms_deferred_vs_hooks=max(
            abs(x - y) for s, t in zip(on_norms, hook_norms) for x, y in zip(s, t)
        ),
        deferred_on=deferred_on,
        batched_on=batched_on,
        batched_off=deferred["batched"] - batched_on,
        deferred_off=deferred_off,
        tails_on=tails_on,
        tails_off=tails_off,
        on_norms=on_norms,
        lane_types=lane_types,
        lanes=len(gsm._lanes),
        hooked=len(gsm._hooked),
        lane_calls=lane_calls,
        off_calls=off_calls,
        left_on=left_on,
        left_off=left_off,
        quiet=quiet,
    )


def failure_while_norms_are_deferred(rank: int, world: int, where: str = "batch") -> dict:
    """A step whose deferred norms raise, then two steps, against two clean steps.

    ``where``: ``"batch"`` breaks the batched Gram finish at the end of the first pass;
    ``"tails"`` (Grams in row blocks of 4 tokens: every contraction in its hook, its elementwise
    tail deferred) breaks the fifth layer's contraction, mid-backward, after earlier layers left
    their tails. Returns the error seen, what the failed step left (deferred jobs and tails, kept
    entries, cached Grams, per-layer state) and the largest difference between the steps after
    the failure and the same steps of a run that never failed.
    """
    base, ids, C = _tiny_setup(world, 2)  # clipping active
    b = B_LOCAL * world
    kwargs = {} if where == "batch" else {"gram_block": 4, "per_sample_grads": False}
    clean, _ = _train(PrivacyEngine(**kwargs), base, ids, rank, world, C, 2, True)
    name = "finish_batch" if where == "batch" else "finish_squares"
    original = getattr(LinearNormSampler, name)
    calls = {"n": 0}
    fail_at = 1 if where == "batch" else 5

    def breaks_once(self, *args):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("batched finish broke" if where == "batch" else "contraction broke")
        return original(self, *args)

    cfg = ShardingConfig.for_precision("fp32")
    model = shard_model(copy.deepcopy(base), cfg, device=torch.device("cpu"))
    with mock.patch.object(LinearNormSampler, name, breaks_once):
        gsm, opt, crit, _ = make_private(
            PrivacyEngine(**kwargs), model, (ids,), b, C, "ghost_fsdp", lr=LR
        )
        x = ids[:b][rank * B_LOCAL : (rank + 1) * B_LOCAL]
        error = None
        try:
            lm_loss(gsm, crit, x).backward()
        except RuntimeError as err:
            error = str(err)
        left = dict(
            deferred=len(gsm._deferred),
            tails=len(gsm._tails),
            kept=len(gsm._kept),
            grams=len(gsm.gram_cache._grams) + len(gsm.gram_cache._readers),
            layers=_left_state(gsm),
        )
        opt.zero_grad()
        after = []
        for s in range(2):
            x = ids[s * b : (s + 1) * b][rank * B_LOCAL : (rank + 1) * B_LOCAL]
            lm_loss(gsm, crit, x).backward()
            opt.step()
            opt.zero_grad()
            after.append(_full_params(model))
    return dict(
        error=error,
        calls=calls["n"],
        left=left,
        after_vs_clean=[_diff(p, q) for p, q in zip(after, clean)],
    )
