"""Subclasses of the layers with a room of their own, and generic layers with frozen parameters,
against the clip-each-sample loop (``opacus_fsdp_sync.testing.per_sample_clipped_grads``).

A subclass that overrides ``forward`` computes another function than its base: the one backward
took the base room's clipped-gradient formula for it (through the MRO) while its norm came from
another path, silently 36 % off the loop (a ``Linear`` with a GELU after it) and 13 % (an
``Embedding`` that scales its output, as transformers' ``ScaledWordEmbedding``). A subclass that
only adds attributes computes what its base does and keeps the base's room, norm included.

One device, fp64 models, fixed batches, clipping active for every sample; one SGD step with
``lr=1``, so each parameter moves by its clipped gradient. The FSDP2 check runs on two gloo
ranks (``tests/workers_layer_subclasses.py``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers import room_for, room_named
from opacus_fsdp_sync.testing import per_sample_clipped_grads, run_ranks
from tests.private import make_private
from tests.workers_layer_subclasses import GeluLinear, TaggedLinear

warnings.filterwarnings("ignore")

B, T, D, V, K = 4, 5, 6, 11, 3
#: fp64 models: the one backward and the loop agree to rounding.
RTOL, ATOL = 1e-7, 1e-10


class ScaledWordEmbedding(nn.Embedding):
    """transformers' ``ScaledWordEmbedding`` (Bart, MBart, BioGpt): the output times a scale."""

    def __init__(self, num: int, dim: int, padding_idx: int, embed_scale: float = 1.0) -> None:
        super().__init__(num, dim, padding_idx)
        self.embed_scale = embed_scale

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


class OnFeatures(nn.Module):
    """``layer`` on ``(B, T, D)`` features, then a head, pooled over the tokens."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.head = layer, nn.Linear(8, K)

    def forward(self, x):
        return self.head(torch.tanh(self.layer(x))).mean(1)


class OnTokens(nn.Module):
    """``layer`` on ``(B, T)`` token ids, then a head, pooled over the tokens."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.head = layer, nn.Linear(D, K)

    def forward(self, ids):
        return self.head(torch.tanh(self.layer(ids))).mean(1)


class ChannelLayers(nn.Module):
    """A ``Linear``, then ``Conv1d`` and ``GroupNorm`` (the generic room's) over the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.group = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, K)

    def forward(self, x):
        h = torch.tanh(self.a(x)).transpose(1, 2)
        h = self.group(h + self.conv(h)).transpose(1, 2)
        return self.head(h).mean(1)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _step_equals_the_loop(model: nn.Module, x: torch.Tensor, options: dict):
    """One private step of ``model`` (fp64) on ``x``, checked against the loop.

    Returns:
        ``(engine, wrapped model)``.

    ``C`` is half the smallest per-sample norm: every sample is clipped.
    """
    torch.manual_seed(2)
    y = torch.randint(0, K, (B,))
    _, norms = per_sample_clipped_grads(copy.deepcopy(model), _loss, x, y, 1.0)
    C = 0.5 * norms.min().item()
    ref, norms = per_sample_clipped_grads(copy.deepcopy(model), _loss, x, y, C)
    assert (norms > C).all()  # clipping active for every sample
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine(**options)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost", lr=1.0)
    crit(gsm(x), y).backward()
    opt.step()
    assert ref.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if n in ref:
            torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=RTOL, atol=ATOL)
        else:
            assert torch.equal(before[n], p.detach()), n  # frozen: untouched
    return engine, gsm


def _gelu_linear() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return OnFeatures(GeluLinear(D, 8)).double(), torch.randn(B, T, D, dtype=torch.float64)


def _scaled_embedding() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = OnTokens(ScaledWordEmbedding(V, D, padding_idx=0, embed_scale=D**0.5)).double()
    ids = torch.randint(0, V, (B, T))
    ids[0, -1] = 0  # a padding token: the embedding's room would skip its row
    return model, ids


OVERRIDES = {"gelu_linear": _gelu_linear, "scaled_embedding": _scaled_embedding}
MODES = {"one_backward": {}, "two_pass": {"one_backward": False}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(OVERRIDES))
def test_a_subclass_that_overrides_forward_equals_the_loop(kind, mode):
    """The subclass is no base layer to the rooms: the generic room computes it (norm and
    clipped gradient, an exact replay of its own forward), on both paths."""
    model, x = OVERRIDES[kind]()
    layer = model.layer
    assert room_for(layer) is room_named("generic")
    engine, gsm = _step_equals_the_loop(model, x, MODES[mode])
    assert engine.one_backward is (mode == "one_backward")  # the path under test ran
    # the norm agrees: the generic replay's, not the base room's
    assert gsm.NORM_SAMPLERS[type(layer)] is room_named("generic").norm


def test_a_subclass_that_keeps_forward_keeps_its_base_room():
    """Only an attribute added: the ``Linear`` room computes the norm and the clipped
    gradient (before, the norm came from the generic replay and the gradient from the
    ``Linear`` room), in one backward, equal to the loop."""
    torch.manual_seed(0)
    model = OnFeatures(TaggedLinear(D, 8)).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    linear = room_named("linear")
    assert room_for(model.layer) is linear
    engine, gsm = _step_equals_the_loop(model, x, {})
    assert engine.one_backward
    assert gsm.NORM_SAMPLERS[TaggedLinear] is linear.norm


@pytest.mark.parametrize("frozen", ["conv.weight", "group.bias"])
def test_generic_layers_with_a_frozen_parameter_equal_the_loop_in_one_backward(frozen):
    """The generic room differentiated every parameter of the layer, frozen ones too: "One of
    the differentiated Tensors does not require grad"."""
    torch.manual_seed(0)
    model = ChannelLayers().double()
    model.get_parameter(frozen).requires_grad_(False)
    assert room_for(model.conv) is room_for(model.group) is room_named("generic")
    x = torch.randn(B, T, D, dtype=torch.float64)
    engine, _ = _step_equals_the_loop(model, x, {})
    assert engine.one_backward


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["overrides", "keeps"])
def test_linear_subclasses_under_fsdp2_equal_the_loop(kind):
    """FSDP2, 2 ranks, default options: a subclass that overrides ``forward`` has no direct
    formula there (the generic replay needs full parameters), so the step takes two passes
    with Opacus's functorch norm (before, the one backward clipped it with the ``Linear``
    formula, 2e-1 off); one that keeps ``forward`` stays on the one backward with the
    ``Linear`` room's norm (before, functorch's). Both equal the loop."""
    from tests import workers_layer_subclasses as w

    results = run_ranks(w.linear_subclass_fsdp2, 2, kind, timeout=240)
    for r in results:
        assert r["all_clipped"]
        assert r["one_backward"] is (kind == "keeps"), r
        assert r["room"] == ("generic" if kind == "overrides" else "linear"), r
        assert r["norm"] == ("functorch" if kind == "overrides" else "room"), r
        assert r["vs_loop"] < 1e-5, r
        assert r["moved"] > 1e-3, r
