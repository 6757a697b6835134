"""Layers without a formula (the generic path) replay the forward that ran, kwargs and RNG included.

Reference: the clip-each-sample loop. For dropout the loop's per-sample gradients are taken from
the batched forward with the same seed (so with the same mask as the engine's forward). Before
replays, Opacus's functorch norm dropped the keyword argument (norms 0.028 off) and failed on
dropout under vmap, and the one-backward step re-ran the layer without its keyword argument and
counted as a second call of a stateful layer.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers import generic as replay
from opacus_fsdp_sync.testing import per_sample_clipped_grads
from tests.private import make_private

warnings.filterwarnings("ignore")
B = 8
TOL = 1e-6
SEEDS = (11, 12)


class GainDrop(nn.Module):
    """A layer no sampler covers: ``dropout(x * w * gain)``; ``gain`` is keyword-only."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.p = p
        self.calls = 0  # state the forward writes (a plain attribute: Opacus refuses buffers)

    def forward(self, x, *, gain=1.0):
        self.calls += 1
        return F.dropout(x * self.weight * gain, self.p, self.training)


class Net(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = GainDrop(32, p)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.mid(torch.tanh(self.inp(x)), gain=2.0))


def _batch_loss(x, y, seed):
    """Sample i's loss from the batched forward under ``seed`` (the engine's dropout masks)."""
    calls = iter(range(x.shape[0]))

    def loss(model, _xi, _yi):
        i = next(calls)
        torch.manual_seed(seed)
        return F.cross_entropy(model(x)[i : i + 1], y[i : i + 1])

    return loss


def _loop(base, x, y, C, lr):
    ref = copy.deepcopy(base)
    clipped = []
    for s, seed in enumerate(SEEDS):
        xs, ys = x[s * B : (s + 1) * B], y[s * B : (s + 1) * B]
        grads, norms = per_sample_clipped_grads(ref, _batch_loss(xs, ys, seed), xs, ys, C)
        clipped.append(int((norms > C).sum()))
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p -= lr * grads[n]
    return {n: p.detach() for n, p in ref.named_parameters()}, clipped


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _train(base, x, y, C, **options):
    model = copy.deepcopy(base)
    engine = PrivacyEngine(**options)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost", lr=0.5)
    assert gsm.NORM_SAMPLERS[GainDrop] is replay.replay_norm_sample
    rng_kept = []
    for s, seed in enumerate(SEEDS):
        torch.manual_seed(seed)
        loss = crit(gsm(x[s * B : (s + 1) * B]), y[s * B : (s + 1) * B])
        after_forward = torch.get_rng_state()
        loss.backward()
        rng_kept.append(torch.equal(torch.get_rng_state(), after_forward))
        opt.step()
        opt.zero_grad()
    assert engine.one_backward is options.get("one_backward", True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model, rng_kept


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["kwarg", "kwarg_and_dropout"])
def test_generic_layer_replays_kwargs_and_dropout_mask(p):
    torch.manual_seed(0)
    base = Net(p)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * B, 16, generator=g), torch.randint(0, 8, (2 * B,), generator=g)
    _, norms = per_sample_clipped_grads(
        copy.deepcopy(base), _batch_loss(x[:B], y[:B], SEEDS[0]), x[:B], y[:B], 1.0
    )
    C = norms.median().item()
    loop, clipped = _loop(base, x, y, C, 0.5)
    assert all(0 < c < B for c in clipped), clipped  # clipping active in both steps
    one, one_model, one_rng = _train(base, x, y, C)
    two, two_model, two_rng = _train(base, x, y, C, one_backward=False)
    assert _diff(one, loop) <= TOL
    assert _diff(two, loop) <= TOL
    assert _diff(one, two) <= TOL
    assert _diff(one, {n: q.detach() for n, q in base.named_parameters()}) > 1e-3
    # The replays drew no random numbers from the user's stream and counted as no call.
    assert all(one_rng) and all(two_rng)
    assert one_model.mid.calls == two_model.mid.calls == len(SEEDS)
    if p:  # dropout really acted: another seed gives another step
        torch.manual_seed(SEEDS[0])
        a = base.mid(torch.ones(4, 32))
        torch.manual_seed(SEEDS[1])
        assert not torch.equal(a, base.mid(torch.ones(4, 32)))


def test_replay_leaves_rng_and_state_alone():
    layer = GainDrop(6, 0.5)
    x = torch.randn(3, 6)
    torch.manual_seed(3)
    call = replay.ForwardCall.record((x,), {"gain": 3.0})
    expected = layer(x, gain=3.0)
    state, calls = torch.get_rng_state(), layer.calls
    again = replay.replay(layer, [x], call)
    assert torch.equal(again, expected)  # same mask, same keyword argument
    assert torch.equal(torch.get_rng_state(), state) and layer.calls == calls
