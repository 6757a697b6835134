"""The RMSNorm norm formula is chosen by what a layer computes, checked against autograd.

Reference: the clip-each-sample loop. A layer named ``LlamaRMSNorm`` whose forward ignores its
``variance_epsilon`` must not get the formula (before the check it did, by name: its norms, and in
one backward its clipped gradient, were off); Hugging Face's ``LlamaRMSNorm`` must keep it.
"""

import copy
import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.hooks import ghost as ghost_hooks
from opacus_fsdp_sync.layers import norms as rms_norm
from opacus_fsdp_sync.layers import room_named
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import seq_sample_loss
from tests.private import make_private

warnings.filterwarnings("ignore")
B, T, D, H = 6, 5, 16, 12
TOL = 1e-6


class NoEpsRMSNorm(nn.Module):
    """Holds ``variance_epsilon`` as Llama's does, but its forward ignores it."""

    def __init__(self, hidden: int, eps: float = 0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))).to(x.dtype)


class OnePlusRMSNorm(NoEpsRMSNorm):
    """Gemma's scale ``(1 + w) * xhat``: a different forward with the same weight gradient."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class ShiftedRMSNorm(NoEpsRMSNorm):
    """Llama's forward with a last operation after the product (its output's node is an add)."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype) + 0.0


for _cls in (NoEpsRMSNorm, OnePlusRMSNorm):  # what a name-based choice would take for Llama's
    _cls.__name__ = _cls.__qualname__ = "LlamaRMSNorm"


class NormNet(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inp = nn.Linear(D, H)
        self.norm = norm
        self.out = nn.Linear(H, 8)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


NORMS = {
    "hf_llama": lambda: LlamaRMSNorm(H, eps=1e-6),
    "ignores_eps": lambda: NoEpsRMSNorm(H),
    "one_plus_weight": lambda: OnePlusRMSNorm(H),
}
#: Whether the layer type must take the direct formula.
DIRECT = {"hf_llama": True, "ignores_eps": False, "one_plus_weight": True}


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture()
def counted(monkeypatch):
    """Counts calls of the direct norm and of the direct one-backward gradient: the room's
    formula, or the weighted sum of the per-sample gradients its norm kept (``(N, H)``)."""
    from opacus_fsdp_sync.one_backward import step

    calls = {"norm": 0, "grad": 0}
    room = room_named("rms_norm")
    norm, grad, weighted = room.norm, room.clipped_grad, step.clipped_sum

    def counting_norm(*args):
        calls["norm"] += 1
        return norm(*args)

    def counting_grad(*args):
        calls["grad"] += 1
        return grad(*args)

    def counting_sum(psgs, scale):
        calls["grad"] += sum(1 for t in psgs.values() if t.dim() == 2)
        return weighted(psgs, scale)

    monkeypatch.setattr(step, "clipped_sum", counting_sum)
    monkeypatch.setattr(rms_norm, "_VERDICTS", {}, raising=False)  # each test checks afresh
    monkeypatch.setattr(rms_norm, "_SAVES_XHAT", {}, raising=False)
    monkeypatch.setattr(room, "norm", counting_norm)
    monkeypatch.setattr(room, "clipped_grad", counting_grad)
    return calls


@pytest.mark.parametrize("one_backward", [True, False])
@pytest.mark.parametrize("kind", list(NORMS))
def test_rms_norm_formula_only_where_autograd_agrees(kind, one_backward, counted, caplog):
    torch.manual_seed(0)
    base = NormNet(NORMS[kind]())
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * B, T, D, generator=g), torch.randint(0, 8, (2 * B, T), generator=g)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), seq_sample_loss, x[:B], y[:B], 1.0)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B  # clipping active
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    engine = PrivacyEngine(one_backward=one_backward)
    with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
        gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost")
    assert engine.one_backward is one_backward
    for s in range(2):
        xs, ys = x[s * B : (s + 1) * B], y[s * B : (s + 1) * B]
        logits = gsm(xs)
        crit(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1), shape=(B, T)).backward()
        opt.step()
        opt.zero_grad()
        clip_each_sample_step(ref, seq_sample_loss, xs, ys, C, 0.5)
    ours = {k: p.detach() for k, p in model.named_parameters()}
    assert _diff(ours, {k: p.detach() for k, p in ref.named_parameters()}) <= TOL
    assert _diff(ours, {k: p.detach() for k, p in base.named_parameters()}) > 1e-3
    # The path taken: the direct norm in each first pass, the direct gradient in each one-backward
    # step; or neither, with a warning naming the layer.
    assert counted["norm"] == (2 if DIRECT[kind] else 0)
    assert counted["grad"] == (2 if DIRECT[kind] and one_backward else 0)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "RMSNorm" in r.message]
    assert len(warned) == (0 if DIRECT[kind] else 1), [r.message for r in warned]


def test_probe_rejects_a_forward_that_ignores_eps_and_accepts_llama():
    assert rms_norm.formula_error(LlamaRMSNorm(H), LlamaRMSNorm) == 0.0
    assert rms_norm.formula_error(OnePlusRMSNorm(H), OnePlusRMSNorm) <= rms_norm.PROBE_RTOL
    assert rms_norm.formula_error(NoEpsRMSNorm(H), NoEpsRMSNorm) > 0.1
    # Llama's eps of 1e-6 too: the probe has a row at the size of sqrt(eps).
    assert rms_norm.formula_error(NoEpsRMSNorm(H, eps=1e-6), NoEpsRMSNorm) > 0.1
    # A forward replaced on one instance cannot be vouched for by its class.
    odd = LlamaRMSNorm(H)
    odd.forward = lambda x: odd.weight * x
    assert not rms_norm.has_rms_formula(odd)
    assert rms_norm.rms_norm_samplers(nn.Sequential(odd, LlamaRMSNorm(H))) == {}
    assert LlamaRMSNorm in rms_norm.rms_norm_samplers(nn.Sequential(LlamaRMSNorm(H)))


class CheckpointedNormNet(NormNet):
    """The norm under non-reentrant activation checkpointing (its saved tensors are packed)."""

    def forward(self, x):
        h = checkpoint(self.norm, self.inp(x), use_reentrant=False)
        return self.out(h)


def _private_steps(net: nn.Module, one_backward: bool, steps: int = 2):
    """Two private steps of ``net`` with clipping active; returns (ours, reference) parameters."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * B, T, D, generator=g), torch.randint(0, 8, (2 * B, T), generator=g)
    _, norms = per_sample_clipped_grads(copy.deepcopy(net), seq_sample_loss, x[:B], y[:B], 1.0)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B  # clipping active
    model, ref = copy.deepcopy(net), copy.deepcopy(net)
    engine = PrivacyEngine(one_backward=one_backward)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost")
    for s in range(steps):
        xs, ys = x[s * B : (s + 1) * B], y[s * B : (s + 1) * B]
        logits = gsm(xs)
        crit(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1), shape=(B, T)).backward()
        opt.step()
        opt.zero_grad()
        clip_each_sample_step(ref, seq_sample_loss, xs, ys, C, 0.5)
    ours = {k: p.detach() for k, p in model.named_parameters()}
    return ours, {k: p.detach() for k, p in ref.named_parameters()}


@pytest.mark.parametrize("one_backward", [True, False])
@pytest.mark.parametrize("case", ["llama", "one_plus_weight", "shifted", "llama_checkpointed"])
def test_rms_norm_reads_the_normalised_input_its_forward_saved(case, one_backward, monkeypatch):
    """Llama's ``w * xhat`` saves ``xhat`` for autograd: the norm reads it, never renormalising.

    So does Gemma-like ``(1 + w) * xhat`` in fp32 (its cast is a no-op there). A forward whose
    last operation is not the product, and a checkpointed norm (its saved tensors packed by the
    checkpoint), renormalise the input, and the checkpoint is not made to recompute in forward:
    the layer runs as often as with the route switched off. Every case is exact against the
    clip-each-sample loop with clipping active.
    """
    monkeypatch.setattr(rms_norm, "_VERDICTS", {})
    monkeypatch.setattr(rms_norm, "_SAVES_XHAT", {})
    calls = {"normalized": 0, "forward": 0}
    normalized = rms_norm.normalized

    def counting(x, eps):
        calls["normalized"] += 1
        return normalized(x, eps)

    monkeypatch.setattr(rms_norm, "normalized", counting)
    torch.manual_seed(0)
    kinds = {"one_plus_weight": OnePlusRMSNorm, "shifted": ShiftedRMSNorm}
    norm = kinds[case](H, eps=1e-6) if case in kinds else LlamaRMSNorm(H, eps=1e-6)
    net = (CheckpointedNormNet if case == "llama_checkpointed" else NormNet)(norm)

    def count_forward(*_):
        calls["forward"] += 1

    def run() -> dict:
        assert rms_norm.has_rms_formula(net.norm)  # the probe, before counting
        calls.update(normalized=0, forward=0)
        hook = net.norm.register_forward_hook(count_forward)
        try:
            ours, ref = _private_steps(net, one_backward)
        finally:
            hook.remove()
        assert _diff(ours, ref) <= TOL
        return dict(calls)

    routed = run()
    routes = case in ("llama", "one_plus_weight")
    assert rms_norm._SAVES_XHAT[type(norm)] is (routes or case == "llama_checkpointed")
    # otherwise each step renormalises once, for the norm (the one-backward gradient reads the
    # kept per-sample gradients; two passes take the gradient from autograd)
    expected = 0 if routes else 2
    assert routed["normalized"] == expected, routed
    monkeypatch.setattr(rms_norm, "_VERDICTS", {})
    monkeypatch.setattr(rms_norm, "_SAVES_XHAT", {})
    monkeypatch.setattr(ghost_hooks, "saved_normalized", lambda *a: None)  # the hooks' name
    off = run()
    assert off["normalized"] == 2  # switched off: renormalised in each step
    assert routed["forward"] == off["forward"], (routed, off)


class ExpandedWeightRMSNorm(NoEpsRMSNorm):
    """Llama's forward with the weight expanded to the input's shape before the product."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = h.to(x.dtype)
        return self.weight.expand_as(h) * h


def _marked_xhat(norm: nn.Module, x: torch.Tensor):
    """The norm's output on ``x`` (requiring gradients) and its marked saved ``xhat``."""
    assert rms_norm.has_rms_formula(norm)
    x = x.clone().requires_grad_()
    out = norm(x)
    return out, rms_norm.saved_normalized(norm, x, out)


def test_saved_xhat_is_read_through_a_permuted_view_and_never_confused(monkeypatch):
    """Opacus's ``batch_first=False`` permutes the captured input: the permuted view of the
    marked ``xhat`` is still read as normalised (renormalising it again would change the norms
    of rows near ``sqrt(eps)``), a copy is not, and an expanded weight (the product's other
    operand, of the input's shape) is never taken for ``xhat``."""
    monkeypatch.setattr(rms_norm, "_VERDICTS", {})
    monkeypatch.setattr(rms_norm, "_SAVES_XHAT", {})
    norm = LlamaRMSNorm(H, eps=1e-6)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, B, H, generator=g) * torch.logspace(-3, 1, B).view(1, B, 1)  # time first
    dy = torch.randn(B, T, H, generator=g)
    _, xhat = _marked_xhat(norm, x)
    assert xhat is not None and rms_norm.is_marked(xhat)
    assert torch.equal(xhat, rms_norm.normalized(x, 1e-6))
    batch_first = xhat.permute(1, 0, 2)  # what Opacus hands the norm
    assert rms_norm.is_marked(batch_first) and not rms_norm.is_marked(batch_first.clone())
    (norms,) = rms_norm.rms_norm_sample(norm, [batch_first], dy).values()
    expected = rms_norm.per_sample_weight_grads(x.permute(1, 0, 2), dy, 1e-6).norm(dim=-1)
    assert torch.allclose(norms, expected, rtol=1e-6, atol=0)
    wrong = rms_norm.per_sample_weight_grads(batch_first.clone(), dy, 1e-6).norm(dim=-1)
    assert not torch.allclose(wrong, expected, rtol=1e-6, atol=0)  # the case would show it
    expanded = ExpandedWeightRMSNorm(H, eps=1e-6)
    out, xhat = _marked_xhat(expanded, x)
    assert len(rms_norm.saved_operands(out.grad_fn)) == 2  # both operands shaped like x
    assert xhat is not None and torch.equal(xhat, rms_norm.normalized(x, 1e-6))


def test_a_type_left_to_opacus_never_reads_the_saved_xhat(monkeypatch):
    """One instance with its own forward leaves its whole type to Opacus's generic per-sample
    gradients: the hooks then keep every instance's input, never a saved ``xhat``, and the
    steps stay exact against the clip-each-sample loop."""
    monkeypatch.setattr(rms_norm, "_VERDICTS", {})
    monkeypatch.setattr(rms_norm, "_SAVES_XHAT", {})
    taken = []
    saved = ghost_hooks.saved_normalized

    def spy(*args):
        out = saved(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(ghost_hooks, "saved_normalized", spy)
    torch.manual_seed(0)
    net = NormNet(LlamaRMSNorm(H, eps=1e-6))
    net.spare = LlamaRMSNorm(H, eps=1e-6)  # never called; its forward replaced
    net.spare.forward = lambda x: net.spare.weight * x
    assert rms_norm.rms_norm_types(net) == set()
    ours, ref = _private_steps(net, one_backward=True)
    assert _diff(ours, ref) <= TOL
    assert not any(taken)


def test_fp32_weight_on_a_bf16_input_gets_autograd_s_fp32_product():
    """With an fp32 weight and a bf16 input the forward's product is fp32, and so is autograd's
    weight gradient: the formula multiplies in the promoted dtype (not the input's)."""
    norm = LlamaRMSNorm(H, eps=1e-6)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, T, H, generator=g).bfloat16()
    dy = torch.randn(3, T, H, generator=g)  # fp32, as the fp32 output's gradient
    auto = []
    for n in range(3):
        out = norm(x[n : n + 1])
        assert out.dtype == torch.float32
        (w,) = torch.autograd.grad(out, norm.weight, dy[n : n + 1])
        auto.append(w)
    ours = rms_norm.per_sample_weight_grads(x, dy, 1e-6)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, torch.stack(auto), rtol=1e-6, atol=1e-7)
