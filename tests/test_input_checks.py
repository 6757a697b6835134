"""Inputs at the edges: refused with a clear error where they cannot be clipped per sample,
else equal to the clip-each-sample loop, never clipped wrong.

One device, fixed batches (``poisson_sampling=False``: these tests are about the model's shape
of input, not about sampling).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from tests.private import make_private

B, T, D, K, C = 4, 5, 6, 5, 0.05


class FlatTokens(nn.Module):
    """Its first ``Linear`` sees the batch merged with the tokens: ``(B * T, d)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(D, 8), nn.Linear(8, K)

    def forward(self, x):
        b, t, d = x.shape
        return self.o(torch.tanh(self.a(x.reshape(b * t, d)))).view(b, t, K)


@pytest.mark.parametrize("options", [{}, {"one_backward": False}], ids=["one", "two_pass"])
def test_a_layer_that_merges_the_batch_with_the_tokens_is_refused(options):
    """Per-sample norms per row (B * T of them): the one backward clipped each token as a sample
    without an error (up to 127 % off the clip-each-sample loop), two passes failed on a shape
    mismatch; both now say what to change, and leave no gradient behind."""
    torch.manual_seed(0)
    model = FlatTokens()
    x, y = torch.randn(B, T, D), torch.randint(0, K, (B, T))
    gsm, opt, crit, _ = make_private(PrivacyEngine(**options), model, (x, y), B, C, "ghost", lr=1.0)
    loss = crit(gsm(x).reshape(-1, K), y.reshape(-1), shape=(B, T))
    with pytest.raises(ValueError, match=r"per-sample norms cover 20 rows but the loss has 4"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())


class FourDims(nn.Module):
    """Two ``Linear`` layers on ``(B, H, T, d)`` inputs, then one on ``(B, T, d)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.h = nn.Linear(D, 7), nn.Linear(7, K, bias=False), nn.Linear(K, K)

    def forward(self, x):
        return self.h(self.b(torch.tanh(self.a(x))).mean(1))


def _sample_loss(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, K), y.reshape(-1))


@pytest.mark.parametrize(
    "options",
    [{}, {"one_backward": False, "fast_norms": False}, {"sync_optimization": False}],
    ids=["default", "upstream_norms", "upstream"],
)
def test_linear_layers_on_four_dimensional_inputs_match_the_clip_each_sample_loop(options):
    """Opacus's own ``Linear`` norm (``fast_norms=False``, and upstream's step) computed none
    for inputs of four dimensions: those layers counted as zero in the flat norm (44 % off the
    loop); their inputs are now flattened to three."""
    from opacus_fsdp_sync.testing import per_sample_clipped_grads

    torch.manual_seed(0)
    model = FourDims()
    x, y = torch.randn(B, 3, T, D), torch.randint(0, K, (B, T))
    ref, norms = per_sample_clipped_grads(copy.deepcopy(model), _sample_loss, x, y, C)
    assert (norms > C).all()  # clipping active for every sample
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gsm, opt, crit, _ = make_private(PrivacyEngine(**options), model, (x, y), B, C, "ghost", lr=1.0)
    crit(gsm(x).reshape(-1, K), y.reshape(-1), shape=(B, T)).backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=1e-4, atol=1e-6)


class Tokens(nn.Module):
    def __init__(self, **embedding) -> None:
        super().__init__()
        self.e, self.o = nn.Embedding(11, D, **embedding), nn.Linear(D, K)

    def forward(self, ids):
        return self.o(self.e(ids))


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
def test_an_embedding_that_scales_by_token_frequency_is_refused_before_anything_is_wrapped(bag):
    """``scale_grad_by_freq=True`` divides by counts over the batch: every path, upstream's too,
    was up to 69 % off the clip-each-sample loop (``EmbeddingBag``: the generic room's)."""
    from opacus_fsdp_sync.errors import UnsupportedConfigurationError

    model = Tokens(scale_grad_by_freq=True)
    if bag:
        model.e = nn.EmbeddingBag(11, D, mode="sum", scale_grad_by_freq=True)
    ids, y = torch.randint(0, 11, (B, T)), torch.randint(0, K, (B, T))
    match = r"e: Embedding\(scale_grad_by" if not bag else r"e: EmbeddingBag\(scale_grad_by"
    with pytest.raises(UnsupportedConfigurationError, match=match):
        make_private(PrivacyEngine(), model, (ids, y), B, C, "ghost")
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("two_dims", [True, False], ids=["2d", "3d"])
@pytest.mark.parametrize(
    "options",
    [{}, {"one_backward": False}, {"sync_optimization": False}],
    ids=["default", "two_pass", "upstream"],
)
def test_a_layer_norm_without_bias_matches_the_clip_each_sample_loop(options, two_dims):
    """Opacus's LayerNorm per-sample gradient read ``layer.bias.requires_grad`` and failed on
    ``LayerNorm(bias=False)``; and the room's per-sample sums of a two-dimensional input summed
    the batch too (``t.sum(())`` sums every dimension)."""
    from opacus_fsdp_sync.testing import per_sample_clipped_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.LayerNorm(8, bias=False), nn.Linear(8, K))
    shape = (B, D) if two_dims else (B, T, D)
    x, y = torch.randn(*shape), torch.randint(0, K, shape[:-1])

    def sample_loss(m, xs, ys):
        return nn.functional.cross_entropy(m(xs).reshape(-1, K), ys.reshape(-1))

    ref, norms = per_sample_clipped_grads(copy.deepcopy(model), sample_loss, x, y, C)
    assert (norms > C).all()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gsm, opt, crit, _ = make_private(PrivacyEngine(**options), model, (x, y), B, C, "ghost", lr=1.0)
    out = gsm(x).reshape(-1, K)
    (crit(out, y) if two_dims else crit(out, y.reshape(-1), shape=(B, T))).backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=1e-4, atol=1e-6)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.up, self.down = nn.Linear(D, 8), nn.Linear(D, 16), nn.Linear(16, K)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))) + self.q(x)[..., :K]


@pytest.mark.parametrize("per_sample_grads", ["auto", True, False])
def test_an_fp64_model_is_clipped_to_fp64_precision(per_sample_grads):
    """fp64: per-sample gradient norms were taken in fp32 (``vector_norm`` refused to narrow,
    a crash), and the one backward's coefficients were fp32 (1e-8 off the loop)."""
    from opacus_fsdp_sync.testing import per_sample_clipped_grads

    torch.manual_seed(0)
    model = Block().double()
    x, y = torch.randn(B, 130, D, dtype=torch.float64), torch.randint(0, K, (B, 130))

    def sample_loss(m, xs, ys):
        return nn.functional.cross_entropy(m(xs).reshape(-1, K), ys.reshape(-1))

    ref, norms = per_sample_clipped_grads(copy.deepcopy(model), sample_loss, x, y, C)
    assert (norms > C).all()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine(per_sample_grads=per_sample_grads)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost", lr=1.0)
    crit(gsm(x).reshape(-1, K), y.reshape(-1), shape=(B, 130)).backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=1e-12, atol=1e-15)


def test_a_layer_called_twice_in_one_forward_is_refused_saying_so():
    """Upstream's message spoke of parameter tying only."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.h = nn.Linear(D, D), nn.Linear(D, K)

        def forward(self, x):
            return self.h(torch.tanh(self.a(torch.tanh(self.a(x)))))

    model = Twice()
    x, y = torch.randn(B, D), torch.randint(0, K, (B,))
    gsm, opt, crit, _ = make_private(PrivacyEngine(), model, (x, y), B, C, "ghost")
    with pytest.raises(NotImplementedError, match="Linear ran twice before a backward"):
        crit(gsm(x), y).backward()


@pytest.mark.parametrize("options", [{}, {"one_backward": False}], ids=["one", "two_pass"])
def test_a_sparse_embedding_matches_the_clip_each_sample_loop(options):
    """``nn.Embedding(sparse=True)``: the two-pass step failed in Opacus's ``add_noise``
    (``add(sparse, dense)``); its second backward's sparse gradient is now made dense, and
    both paths equal the clip-each-sample loop."""
    from opacus_fsdp_sync.testing import per_sample_clipped_grads

    torch.manual_seed(0)
    model = Tokens(sparse=True)
    ids, y = torch.randint(0, 11, (B, T)), torch.randint(0, K, (B, T))
    dense = Tokens()
    dense.load_state_dict(model.state_dict())
    ref, norms = per_sample_clipped_grads(dense, _sample_loss, ids, y, C)
    assert (norms > C).all()  # clipping active for every sample
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(**options), model, (ids, y), B, C, "ghost", lr=1.0
    )
    crit(gsm(ids).reshape(-1, K), y.reshape(-1), shape=(B, T)).backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), ref[n], rtol=1e-4, atol=1e-6)
