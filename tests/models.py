"""Small models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class Tripwire(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` is set: a backward that fails midway."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Tripwire.armed:
            raise RuntimeError("tripwire: injected failure in backward")
        return grad


class ToyNet(nn.Module):
    """Opacus-style toy classifier: three blocks (Linear, LayerNorm, ReLU) and a head."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU()),
                nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
                nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU()),
            ]
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = Tripwire.apply(x)
        return self.head(x)


def toy_sample_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


class SharedInputSeqNet(nn.Module):
    """Sequence model whose Linear layers share inputs as in a Llama block.

    ``q``/``k``/``v`` read the same tensor, ``gate``/``up`` another, ``down`` a third: three
    distinct Linear inputs for six Linear layers (some with bias).
    """

    def __init__(self, d: int = 16, classes: int = 8):
        super().__init__()
        self.q = nn.Linear(d, 12)
        self.k = nn.Linear(d, 12, bias=False)
        self.v = nn.Linear(d, 12, bias=False)
        self.gate = nn.Linear(12, 20, bias=False)
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, classes)

    def forward(self, x):
        h = torch.tanh(self.q(x)) * self.k(x) + self.v(x)
        return self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def seq_sample_loss(model, x, y):
    """Token-averaged cross entropy of one sample (``x``: (T, d), ``y``: (T,))."""
    logits = model(x[None])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
