"""One-output layers report their output gradient through a tensor hook, not a full backward hook.

Reference: the clip-each-sample loop, and the same steps with every layer on Opacus's full
backward hooks (the route before), which must agree bit for bit. Clipping is active in every
test; fixed batches (the hook route does not depend on how batches are drawn).
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.errors import UnsupportedConfigurationError
from opacus_fsdp_sync.hooks import ghost as ghost_hooks
from opacus_fsdp_sync.hooks import output_grads
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import make_private

warnings.filterwarnings("ignore")
B, T, V, D = 6, 5, 11, 12


class MixedNet(nn.Module):
    """Embedding, RMSNorm, Linear, LayerNorm (one output each) and a Conv1d (full backward hook)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm = LlamaRMSNorm(D, eps=1e-6)
        self.proj = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.conv = nn.Conv1d(D, D, kernel_size=3, padding=1)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.ln(torch.tanh(self.proj(self.norm(self.emb(ids)))))
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def sample_loss(model, ids, targets):
    logits = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def _data():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (2 * B, T), generator=g)
    return ids, torch.randint(0, V, (2 * B, T), generator=g)


def _bound(base, ids, targets) -> float:
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), sample_loss, ids[:B], targets[:B], 1)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B  # clipping active
    return C


def _steps(base, ids, targets, C, *, one_backward, after_hook=None):
    """Two private steps; returns the parameters and the engine's hooks object."""
    model = copy.deepcopy(base)
    engine = PrivacyEngine(one_backward=one_backward)
    gsm, opt, crit, _ = make_private(engine, model, (ids, targets), B, C, "ghost")
    if after_hook is not None:
        after_hook(model)
    for s in range(2):
        xs, ys = ids[s * B : (s + 1) * B], targets[s * B : (s + 1) * B]
        logits = gsm(xs)
        crit(logits.reshape(-1, V), ys.reshape(-1), shape=(B, T)).backward()
        opt.step()
        opt.zero_grad()
    return {k: p.detach().clone() for k, p in model.named_parameters()}, gsm


def _loop(base, ids, targets, C, after_hook=None):
    ref = copy.deepcopy(base)
    if after_hook is not None:
        after_hook(ref)
    for s in range(2):
        xs, ys = ids[s * B : (s + 1) * B], targets[s * B : (s + 1) * B]
        clip_each_sample_step(ref, sample_loss, xs, ys, C, 0.5)
    return {k: p.detach() for k, p in ref.named_parameters()}


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture()
def full_backward_hooks_only(monkeypatch):
    """The route before: every layer on Opacus's full backward hook."""

    def route_before():
        monkeypatch.setattr(output_grads, "ONE_OUTPUT_TYPES", ())
        monkeypatch.setattr(ghost_hooks._Ours, "one_output_layer_types", lambda self: set())

    return route_before


@pytest.mark.parametrize("one_backward", [True, False])
def test_tensor_hooks_equal_full_backward_hooks_and_the_loop(
    one_backward, full_backward_hooks_only
):
    torch.manual_seed(0)
    base = MixedNet()
    ids, targets = _data()
    C = _bound(base, ids, targets)
    ours, gsm = _steps(base, ids, targets, C, one_backward=one_backward)
    # the one-output layers have no full backward hook; the Conv1d keeps Opacus's
    layers = dict(gsm._module.named_children())
    for name in ("emb", "norm", "proj", "ln", "head"):
        assert id(layers[name]) in gsm._output_hooked, name
        assert not layers[name]._backward_hooks, name
    assert id(layers["conv"]) not in gsm._output_hooked
    assert len(layers["conv"]._backward_hooks) == 1
    full_backward_hooks_only()
    before, gsm_before = _steps(base, ids, targets, C, one_backward=one_backward)
    assert not gsm_before._output_hooked
    assert _diff(ours, before) == 0.0
    assert _diff(ours, _loop(base, ids, targets, C)) <= 1e-6
    assert _diff(ours, {k: p.detach() for k, p in base.named_parameters()}) > 1e-3


def _doubling_hook(model):
    """A forward hook, registered after Opacus's, that replaces the projection's output."""
    model.proj.register_forward_hook(lambda module, inputs, output: 2.0 * output)


@pytest.mark.parametrize("one_backward", [True, False])
def test_a_later_hook_replacing_the_output_keeps_the_layers_own_gradient(one_backward):
    """The norms read the gradient w.r.t. the layer's own output: the loop's per-sample gradient.

    (A full backward hook reads the gradient w.r.t. the replaced output, half the layer's own
    here.)
    """
    torch.manual_seed(0)
    base = MixedNet()
    ids, targets = _data()
    hooked = copy.deepcopy(base)
    _doubling_hook(hooked)
    C = _bound(hooked, ids, targets)
    ours, _ = _steps(base, ids, targets, C, one_backward=one_backward, after_hook=_doubling_hook)
    assert _diff(ours, _loop(base, ids, targets, C, after_hook=_doubling_hook)) <= 1e-6


class InPlaceNet(MixedNet):
    """In-place ops on a Linear's sequence output (a view): a residual ``+=`` and ``relu_``."""

    def forward(self, ids):
        e = self.emb(ids)
        h = self.proj(e)
        h += e
        g = nn.functional.relu(self.ln(h), inplace=True)
        return self.head(g)


@pytest.mark.parametrize("one_backward", [True, False])
def test_in_place_ops_on_a_view_output_keep_the_layers_own_gradient(one_backward):
    """A hook on a view is dropped by an in-place op on it; the layer returns a non-view alias.

    On torch 2.13 a Linear's output on a sequence is a view (from 2.15 it is not: the alias is
    not needed there, and the step is the same).
    """
    torch.manual_seed(0)
    base = InPlaceNet()
    ids, targets = _data()
    C = _bound(base, ids, targets)
    seen = []

    def record(model):  # a hook after Opacus's sees what the layer returns
        model.proj.register_forward_hook(lambda m, i, out: seen.append(out._base is None))

    ours, _ = _steps(base, ids, targets, C, one_backward=one_backward, after_hook=record)
    assert seen == [True, True]  # the alias, not the view
    assert _diff(ours, _loop(base, ids, targets, C)) <= 1e-6
    assert _diff(ours, {k: p.detach() for k, p in base.named_parameters()}) > 1e-3


def test_a_one_output_layer_returning_a_tuple_is_refused():
    torch.manual_seed(0)
    base = MixedNet()
    proj = base.proj
    base.proj.forward = lambda x: (nn.functional.linear(x, proj.weight, proj.bias),)
    base.forward = lambda ids: base.head(base.proj(base.emb(ids))[0])
    ids, targets = _data()
    engine = PrivacyEngine()
    gsm, _, _, _ = make_private(engine, base, (ids, targets), B, 1.0, "ghost")
    with pytest.raises(UnsupportedConfigurationError, match="Linear returned tuple"):
        gsm(ids[:B])
