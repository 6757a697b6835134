"""Checks of the fused Linear kernels under Triton's CPU interpreter, run in one subprocess.

``python -m tests.workers_kernels OUT.json`` with ``TRITON_INTERPRET=1`` in the environment (set
before anything imports triton) runs every case in :data:`CASES` and writes
``{case: {"ok": bool, "detail": str}}``; ``tests/test_kernels.py`` asserts each case. Shapes are
small (the interpreter runs kernels through numpy) and tiles are 16, so ``T = 37`` and widths
21 / 45 leave partial tiles. Each kernel is compared with the torch path on the same inputs in
fp32 (bf16 inputs upcast exactly): the norms to fp32 rounding, the clipped gradient to its
dtype's rounding (one bf16 ulp; fp32 rounding in fp32).
"""

from __future__ import annotations

import copy
import json
import sys
import traceback

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.workers_noise_kernel import CASES as NOISE_CASES
from tests.workers_row_kernels import CASES as ROW_CASES
from tests.workers_row_kernels import seq_loss, seq_net_step_against_the_loop

#: Relative tolerance of a fp32 accumulation against another summation order.
RTOL_FP32 = 2e-5


class OpLog(TorchDispatchMode):
    """Records the names of the ``opacus_fsdp_sync`` custom ops that run (proof of the path)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "opacus_fsdp_sync":
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _inputs(n, t, d_in, d_out, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, t, d_in, generator=gen).to(dtype)
    g = torch.randn(n, t, d_out, generator=gen).to(dtype)
    return a, g


def _close(got, want, rtol, what):
    got, want = got.double(), want.double()
    err = ((got - want).abs() / want.abs().clamp(min=1e-30)).max().item() if want.numel() else 0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"
    return f"{what}: rel err {err:.1e}"


def _close_normwise(got, want, rtol, what):
    """A gradient: the largest error against the largest entry (entries may cancel to ~0)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err <= rtol, f"{what}: error {err:.2e} of the largest entry > {rtol:.0e}"
    return f"{what}: error {err:.1e} of the largest entry"


def _check_norm_ops(n, t, d_in, d_out, dtype):
    from opacus_fsdp_sync.layers.kernels import ops

    a, g = _inputs(n, t, d_in, d_out, dtype)
    oracle = ops.ghost_norm_reference(a.float(), g.float(), 0)  # full Grams, fp32
    with OpLog() as log:
        ghost = ops.ghost_norm_linear(a, g, 16)
        psg = ops.per_sample_norm_linear(a, g)
    assert log.ops == ["ghost_norm_linear", "per_sample_norm_linear"], log.ops
    assert ghost.dtype == psg.dtype == torch.float32
    return "; ".join(
        [
            _close(ghost, oracle, RTOL_FP32, "ghost norm"),
            _close(psg, oracle, RTOL_FP32, "per-sample-gradient norm"),
        ]
    )


def _check_clipped_op(n, t, d_in, d_out, dtype):
    from opacus_fsdp_sync.layers.kernels import ops

    a, g = _inputs(n, t, d_in, d_out, dtype, seed=1)
    coef = torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.1
    got = ops.clipped_grad_linear(a, g, coef)
    assert got.dtype == dtype
    # The torch path scales g into its dtype (rounded once), then one matmul: here in fp64.
    scaled = torch.mul(g, coef.view(-1, 1, 1), out=torch.empty_like(g)).double()
    exact = scaled.reshape(-1, d_out).t() @ a.double().reshape(-1, d_in)
    # Summation error scales with sum |g| |a| (terms cancel); the output dtype's own rounding
    # with |exact|: bf16 is within one ulp (2^-8), fp32 within fp32 accumulation error.
    mag = scaled.abs().reshape(-1, d_out).t() @ a.double().abs().reshape(-1, d_in)
    torch_path = ops.clipped_grad_reference(a, g, coef).double()
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(dtype, 0.0)
    for name, other, ulps in (("exact", exact, 1), ("torch path", torch_path, 2)):
        excess = (got.double() - other).abs() - ulps * ulp * other.abs()
        err = (excess / mag).max().item()
        assert err <= RTOL_FP32, f"clipped gradient vs {name}: {err:.2e} of sum |g||a|"
    return f"clipped gradient: within {ulp:.0e} |x| + {err:.1e} sum |g||a| of the torch path"


def _case_ops(dtype, n=3, t=37, d_in=21, d_out=45):
    return lambda: "; ".join(
        [_check_norm_ops(n, t, d_in, d_out, dtype), _check_clipped_op(n, t, d_in, d_out, dtype)]
    )


def case_empty_batch():
    """N = 0: empty norms, a zero gradient, and no kernel launch."""
    from opacus_fsdp_sync.layers.kernels import ops, triton_linear

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty batch")

    names = ("ghost_norm", "per_sample_norm", "clipped_grad")
    saved = {k: getattr(triton_linear, k) for k in names}
    try:
        for k in saved:
            setattr(triton_linear, k, refuse)
        a, g = _inputs(0, 37, 21, 45, torch.bfloat16)
        ghost = ops.ghost_norm_linear(a, g, 16)
        psg = ops.per_sample_norm_linear(a, g)
        grad = ops.clipped_grad_linear(a, g, torch.ones(0))
    finally:
        for k, f in saved.items():
            setattr(triton_linear, k, f)
    assert ghost.shape == psg.shape == (0,) and ghost.dtype == torch.float32
    assert grad.shape == (45, 21) and grad.dtype == torch.bfloat16 and not grad.any()
    return "empty results, no launch"


def _sampler_norms(layer, a, g, fused):
    from opacus_fsdp_sync.layers.linear import GramCache, make_linear_norm_sampler

    sampler = make_linear_norm_sampler(GramCache(0), fused_kernels=fused)
    with OpLog() as log:
        norms = sampler(layer, [a], g)
    return {n: norms[p] for n, p in layer.named_parameters() if p in norms}, log.ops


def case_tied_head():
    """A head of vocabulary-like width through the norm sampler (the tied head's own norm)."""
    torch.manual_seed(0)
    head = nn.Linear(24, 200, bias=False)
    a, g = _inputs(2, 19, 24, 200, torch.bfloat16, seed=3)
    fused, ops_run = _sampler_norms(head, a, g, True)
    assert ops_run == ["ghost_norm_linear"], ops_run
    torch_path, none = _sampler_norms(head, a.float(), g.float(), False)
    assert not none
    return _close(fused["weight"], torch_path["weight"], RTOL_FP32, "head norm")


def case_sampler_picks_the_cheaper_kernel():
    """Narrow layer, longer sequence: the per-sample-gradient epilogue has fewer FLOPs."""
    layer = nn.Linear(8, 8)
    a, g = _inputs(2, 64, 8, 8, torch.float32, seed=4)
    fused, ops_run = _sampler_norms(layer, a, g, True)
    assert ops_run == ["per_sample_norm_linear"], ops_run
    torch_path, _ = _sampler_norms(layer, a, g, False)
    return "; ".join(_close(fused[k], torch_path[k], RTOL_FP32, k) for k in ("weight", "bias"))


def case_room_clipped_grad():
    """The room's folded clipped gradient (4-D input, bias) against its scaled torch path."""
    from opacus_fsdp_sync.layers import room_for

    layer = nn.Linear(21, 45)
    room = room_for(layer, nn.Linear)
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(3, 4, 5, 21, generator=gen)
    g = torch.randn(3, 4, 5, 45, generator=gen)
    coef = torch.rand(3, generator=gen)
    with OpLog() as log:
        fused = room.clipped_grad_folded(layer, [a], g, coef, True)
    assert log.ops == ["clipped_grad_linear"], log.ops
    assert room.clipped_grad_folded(layer, [a], g, coef, False) is None
    assert room.clipped_grad_folded(layer, [a.double()], g.double(), coef, True) is None
    ref = room.clipped_grad(layer, [a], g, coef)
    return "; ".join(_close_normwise(fused[k], ref[k], RTOL_FP32, k) for k in ("weight", "bias"))


def case_dtensor_local_shards():
    """DTensor inputs (a 1-rank gloo mesh named tp): the kernels run on the local shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from opacus_fsdp_sync.layers.kernels import linear_clipped_grad, linear_sq_norms

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        layer = nn.Linear(21, 45)
        a, g = _inputs(2, 37, 21, 45, torch.float32, seed=7)
        da, dg = distribute_tensor(a, mesh, [Shard(2)]), distribute_tensor(g, mesh, [Shard(2)])
        coef = torch.tensor([0.5, 1.5])
        with OpLog() as log:
            norms = linear_sq_norms(layer, da, dg, True)
            grads = linear_clipped_grad(layer, [da], dg, coef, True)
        assert log.ops[0] in ("ghost_norm_linear", "per_sample_norm_linear"), log.ops
        assert log.ops[1:] == ["clipped_grad_linear"], log.ops
        assert all(type(t) is torch.Tensor for t in [*norms.values(), *grads.values()])
        plain_norms = linear_sq_norms(layer, a, g, True)
        plain = linear_clipped_grad(layer, [a], g, coef, True)
    finally:
        dist.destroy_process_group()
    parts = [_close(norms[k], plain_norms[k], 0.0, f"norm {k}") for k in norms]
    return "; ".join(parts + [_close(grads[k], plain[k], 0.0, f"grad {k}") for k in grads])


def case_engine_one_backward():
    """The engine with ``fused_kernels=True``: the clip-each-sample loop's parameters."""
    from opacus_fsdp_sync import PrivacyEngine

    def step(gsm, opt, crit, x, y):
        loss = seq_loss(gsm, crit, x, y)
        with OpLog() as log:
            loss.backward()
        opt.step()
        norm_ops = log.ops.count("ghost_norm_linear") + log.ops.count("per_sample_norm_linear")
        assert norm_ops == 6 and log.ops.count("clipped_grad_linear") == 6, log.ops

    engine = PrivacyEngine(fused_kernels=True, per_sample_grads=False, tune_norms=False)
    return seq_net_step_against_the_loop(engine, step)


def case_engine_tied_llama():
    """A tiny Llama with tied embeddings: the head's norm and gradient from the kernels, the
    cross term with the embedding in torch; the clip-each-sample loop's parameters."""
    from opacus_fsdp_sync import PrivacyEngine
    from opacus_fsdp_sync.models import LlamaSpec, build_llama
    from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
    from tests.private import lm_loss, make_private
    from tests.workers_tied import llama_sample_loss

    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=True))
    assert base.lm_head.weight is base.model.embed_tokens.weight
    linears = sum(isinstance(m, nn.Linear) for m in base.modules())
    b = 3
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, base.config.vocab_size, (b, 12), generator=gen)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), llama_sample_loss, ids, ids, 1.0)
    clip = norms.median().item()
    model = copy.deepcopy(base)
    engine = PrivacyEngine(fused_kernels=True, per_sample_grads=False, tune_norms=False)
    gsm, opt, crit, _ = make_private(engine, model, (ids,), b, clip, "ghost", lr=0.5)
    loss = lm_loss(gsm, crit, ids)
    with OpLog() as log:
        loss.backward()
    opt.step()
    norm_ops = log.ops.count("ghost_norm_linear") + log.ops.count("per_sample_norm_linear")
    assert norm_ops == linears and log.ops.count("clipped_grad_linear") == linears, log.ops
    ref = copy.deepcopy(base)
    clip_each_sample_step(ref, llama_sample_loss, ids, ids, clip, 0.5)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    err = max((got[k] - want[k]).abs().max().item() for k in got)
    moved = max((got[k] - p).abs().max().item() for k, p in base.named_parameters())
    assert err <= 1e-5 and moved > 1e-3, (err, moved)
    return f"{linears} Linear layers; parameters {err:.1e} from the loop (update {moved:.1e})"


CASES = {
    "ops_fp32": _case_ops(torch.float32),
    "ops_bf16": _case_ops(torch.bfloat16),
    "ops_fp16": _case_ops(torch.float16, t=20),
    "ops_one_sample": _case_ops(torch.bfloat16, n=1),
    "ops_short_sequence": _case_ops(torch.float32, t=5, d_in=16, d_out=33),
    "ops_tile_multiples": _case_ops(torch.bfloat16, n=2, t=32, d_in=16, d_out=32),
    "empty_batch": case_empty_batch,
    "tied_head": case_tied_head,
    "sampler_picks_the_cheaper_kernel": case_sampler_picks_the_cheaper_kernel,
    "room_clipped_grad": case_room_clipped_grad,
    "dtensor_local_shards": case_dtensor_local_shards,
    "engine_one_backward": case_engine_one_backward,
    "engine_tied_llama": case_engine_tied_llama,
    **ROW_CASES,
    **NOISE_CASES,
}


def main(out: str) -> None:
    """Runs every case and writes the results to ``out``."""
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = {"ok": True, "detail": case()}
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = {"ok": False, "detail": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
