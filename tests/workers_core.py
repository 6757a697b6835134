"""Rank functions for the core tests (run by opacus_fsdp_sync.testing.run_ranks)."""

from __future__ import annotations

import contextlib
import copy
import warnings

import opacus
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine, phase
from opacus_fsdp_sync.distributed import _fsdp2_internals as internals
from opacus_fsdp_sync.profiling import PhaseFlopCounter
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import ToyNet, Tripwire, toy_sample_loss
from tests.private import capture_ghost_log, lm_loss, make_private

warnings.filterwarnings("ignore")
LR = 0.5
B_LOCAL = 4
#: Our option sets: sync skip only, + keep unsharded, + activations-only first pass, both.
_UPSTREAM_NORMS = dict(fast_norms=False)
OPTION_SETS = {
    "sync": dict(restricted_first_pass=False, keep_unsharded=False, one_backward=False),
    "keep": dict(restricted_first_pass=False, keep_unsharded=True, one_backward=False),
    "restricted": dict(restricted_first_pass=True, keep_unsharded=False, one_backward=False),
    "parity": dict(restricted_first_pass=True, keep_unsharded=True, one_backward=False),
    "one_backward": dict(restricted_first_pass=True, keep_unsharded=False, one_backward=True),
}
for _name in ("sync", "keep", "restricted", "parity"):  # upstream's norm kernels: bit for bit
    OPTION_SETS[_name].update(_UPSTREAM_NORMS)
#: Sets whose result must equal upstream bit for bit (the others: to fp32 rounding).
BIT_EXACT = ("sync", "keep", "restricted", "parity")


def _data(world: int, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = B_LOCAL * world * steps
    return torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)


def _shard(model: nn.Module, world: int, dtype: str) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = t.detach().float().clone()
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _make_private(engine, model, x, y, world, C, mode, **kw):
    """Opacus's expected batch is the loader's batch divided by the world size (1 here when
    ``mode`` is single-process ``ghost``, whose loader batch is the global batch)."""
    return make_private(engine, model, (x, y), B_LOCAL * world, C, mode, lr=LR, **kw)


def _groups_state(model):
    groups = list(internals.iter_param_groups([model]))
    fps = [fp for g in groups for fp in internals.fsdp_params(g)]
    holds = sum(internals.holds_unsharded_grad(fp) for fp in fps)
    flags = [internals.get_sync_flags(g) for g in groups]
    return holds, flags


def _run_fsdp(engine, base, x, y, rank, world, C, dtype, steps, microbatches=1, probe=False):
    """Runs ``steps`` DP steps; returns params after each step, counts and probe results."""
    model = _shard(copy.deepcopy(base), world, dtype)
    gsm, opt, crit, _ = _make_private(engine, model, x, y, world, C, "ghost_fsdp")
    between = []
    if probe:
        orig = gsm.get_clipping_coef

        def probed():
            between.append(_groups_state(model))
            return orig()

        gsm.get_clipping_coef = probed
    params, counts, norms = [], [], []
    flops = PhaseFlopCounter()
    b = B_LOCAL * world
    for s in range(steps):
        xs, ys = x[s * b : (s + 1) * b], y[s * b : (s + 1) * b]
        lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
        xl, yl = xs[lo:hi], ys[lo:hi]
        with CollectiveCounter() as counter, flops if s == 0 else contextlib.nullcontext():
            mb = B_LOCAL // microbatches
            step_norms = []
            for m in range(microbatches):
                with phase("forward"):
                    out = gsm(xl[m * mb : (m + 1) * mb])
                loss = crit(out, yl[m * mb : (m + 1) * mb])
                loss.backward()
                step_norms.append(gsm.per_sample_gradient_norms.detach().clone())
                with phase("optimizer_step"):
                    if m < microbatches - 1:
                        opt.signal_skip_step(do_skip=True)
                    opt.step()
                    opt.zero_grad()
        norms.append(torch.cat(step_norms))
        counts.append(counter.as_dict())
        params.append(_full_params(model))
    return dict(
        params=params,
        counts=counts,
        norms=norms,
        between=between,
        flops=dict(flops.flops),
        matmuls={k: list(v) for k, v in flops.matmul_shapes.items()},
    )


def _nodp_counts(base, x, y, rank, world):
    """Collectives of one non-private step of the same sharded model (the floor)."""
    model = _shard(copy.deepcopy(base), world, "fp32")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    with CollectiveCounter() as counter:
        nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    return counter.as_dict()


def core_exactness(
    rank: int, world: int, dtype: str = "fp32", steps: int = 2, sets=tuple(OPTION_SETS)
) -> dict:
    """Ours vs upstream ghost_fsdp vs single-process ghost vs the clip-each-sample loop."""
    torch.manual_seed(0)
    base = ToyNet()
    x, y = _data(world, steps)
    b = B_LOCAL * world
    # C: the median per-sample norm of the first batch, so that about half are clipped.
    _, norms0 = per_sample_clipped_grads(copy.deepcopy(base), toy_sample_loss, x[:b], y[:b], 1.0)
    C = norms0.median().item()

    ref = copy.deepcopy(base)
    ref_params, ref_norms = [], []
    for s in range(steps):
        ref_norms.append(
            clip_each_sample_step(
                ref, toy_sample_loss, x[s * b : (s + 1) * b], y[s * b : (s + 1) * b], C, LR
            )
        )
        ref_params.append({n: p.detach().clone() for n, p in ref.named_parameters()})

    single = copy.deepcopy(base)
    gsm1, opt1, crit1, _ = _make_private(opacus.PrivacyEngine(), single, x, y, world, C, "ghost")
    single_params = []
    for s in range(steps):
        loss = crit1(gsm1(x[s * b : (s + 1) * b]), y[s * b : (s + 1) * b])
        loss.backward()
        opt1.step()
        opt1.zero_grad()
        single_params.append({n: p.detach().clone() for n, p in single.named_parameters()})

    upstream = _run_fsdp(opacus.PrivacyEngine(), base, x, y, rank, world, C, dtype, steps)
    result = dict(
        C=C,
        ref_norms=[n.tolist() for n in ref_norms],
        upstream_counts=upstream["counts"],
        nodp_counts=_nodp_counts(base, x, y, rank, world),
        upstream_vs_loop=[_max_diff(a, b_) for a, b_ in zip(upstream["params"], ref_params)],
        update_size=[
            _max_diff(p, {n: t.float() for n, t in _full_params(base).items()}) for p in ref_params
        ],
        weight_shapes=[tuple(p.shape) for n, p in base.named_parameters() if p.dim() == 2],
        sets={},
    )
    for name in sets:
        engine = PrivacyEngine(**OPTION_SETS[name])
        ours = _run_fsdp(engine, base, x, y, rank, world, C, dtype, steps, probe=True)
        result["sets"][name] = dict(
            keep_unsharded=engine.keep_unsharded,
            one_backward=engine.one_backward,
            norms=[n.tolist() for n in ours["norms"]],
            counts=ours["counts"],
            between=ours["between"],
            flops=ours["flops"],
            matmuls=ours["matmuls"],
            vs_upstream=[_max_diff(a, b_) for a, b_ in zip(ours["params"], upstream["params"])],
            vs_single=[_max_diff(a, b_) for a, b_ in zip(ours["params"], single_params)],
            vs_loop=[_max_diff(a, b_) for a, b_ in zip(ours["params"], ref_params)],
        )
    return result


def accumulation(rank: int, world: int) -> dict:
    """Two microbatches with a skipped step equal one batch; a failed backward restores sync."""
    torch.manual_seed(0)
    base = ToyNet()
    x, y = _data(world, 3)
    b = B_LOCAL * world
    _, norms0 = per_sample_clipped_grads(copy.deepcopy(base), toy_sample_loss, x[:b], y[:b], 1.0)
    C = norms0.median().item()
    one = _run_fsdp(PrivacyEngine(), base, x, y, rank, world, C, "fp32", 2)
    two = _run_fsdp(PrivacyEngine(), base, x, y, rank, world, C, "fp32", 2, microbatches=2)
    ref = copy.deepcopy(base)
    ref_params = []
    for s in range(2):
        clip_each_sample_step(
            ref, toy_sample_loss, x[s * b : (s + 1) * b], y[s * b : (s + 1) * b], C, LR
        )
        ref_params.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return dict(
        accum_vs_one=[_max_diff(a, b_) for a, b_ in zip(two["params"], one["params"])],
        accum_vs_loop=[_max_diff(a, b_) for a, b_ in zip(two["params"], ref_params)],
    )


def failure_recovery(rank: int, world: int) -> dict:
    """A first backward that raises midway leaves sync on, and the next steps are exact."""
    torch.manual_seed(0)
    base = ToyNet()
    x, y = _data(world, 3)
    b = B_LOCAL * world
    _, norms0 = per_sample_clipped_grads(copy.deepcopy(base), toy_sample_loss, x[:b], y[:b], 1.0)
    C = norms0.median().item()
    model = _shard(copy.deepcopy(base), world, "fp32")
    # (sync turned off by the user is refused before the first pass: tests/test_reduction_checks)
    gsm, opt, crit, _ = _make_private(PrivacyEngine(), model, x, y, world, C, "ghost_fsdp")
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL
    Tripwire.armed = True
    error = None
    try:
        crit(gsm(x[lo:hi]), y[lo:hi]).backward()
    except RuntimeError as err:
        error = str(err)
    finally:
        Tripwire.armed = False
    holds, flags = _groups_state(model)
    after_failure = dict(error=error, holds=holds, flags=flags, hooks_enabled=gsm.hooks_enabled)
    opt.zero_grad()
    ref = copy.deepcopy(base)
    for s in range(2):
        xs, ys = x[(s + 1) * b : (s + 2) * b], y[(s + 1) * b : (s + 2) * b]
        crit(gsm(xs[lo:hi]), ys[lo:hi]).backward()
        opt.step()
        opt.zero_grad()
        clip_each_sample_step(ref, toy_sample_loss, xs, ys, C, LR)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return dict(after_failure=after_failure, vs_loop=_max_diff(_full_params(model), ref_params))


def tiny_llama_trains(rank: int, world: int, steps: int = 6) -> dict:
    """A tiny untied LlamaForCausalLM trains under FSDP2 with our engine; timing lines logged."""
    from opacus_fsdp_sync.models import LlamaSpec, build_llama, decoder_layers

    records = capture_ghost_log()
    torch.manual_seed(0)
    model = build_llama(LlamaSpec(preset="tiny"))
    mesh = init_device_mesh("cpu", (world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seq, vocab = 16, model.config.vocab_size
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(1, vocab, (B_LOCAL, seq), generator=g)
    engine = PrivacyEngine(timing=True)
    adam = torch.optim.Adam(model.parameters(), lr=3e-3)
    gsm, opt, crit, _ = make_private(
        engine, model, (ids,), B_LOCAL * world, 1.0, "ghost_fsdp", optimizer=adam
    )
    losses = []
    for _ in range(steps):
        loss = lm_loss(gsm, crit, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, records=records, timings=engine.last_step_timings)
