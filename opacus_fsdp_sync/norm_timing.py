"""Timing the exact Linear norm candidates of :mod:`.norm_tuner` on a layer's real inputs.

Each candidate is timed as what it costs in the step: a Gram strategy as the layer's share of its
input's Gram (shared by the layers reading that input), the output-gradient Gram and the
contraction; per-sample gradients as their batched matmul, norms and the weighted sum that then
gives the clipped gradient. CUDA events on CUDA (each timing waits for the device: tuning is
one-off work), ``time.perf_counter`` elsewhere; the fastest of a few calls after a warm-up counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .block_gram import contract_output_grams, upper_gram


@dataclass(frozen=True)
class Candidate:
    """One exact norm strategy: per-sample gradients, or Grams in row blocks (0: full Grams)."""

    block: int = 0
    per_sample: bool = False

    def __str__(self) -> str:
        if self.per_sample:
            return "per-sample gradients"
        return f"Gram blocks of {self.block}" if self.block else "full Grams"


def _clock_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up: CUDA events on CUDA, else wall clock."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def candidate_timer(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, readers: int, repeats: int
) -> Callable[[Candidate, bool], float]:
    """Times candidates on this layer's real input ``a`` and output gradient ``g``.

    Returns:
        ``cost(candidate, with_weight_grad) -> ms``; ``with_weight_grad`` adds the
        weight-gradient matmul to the Gram candidates (when per-sample gradients, which replace
        it, are a candidate too).
    """
    from .one_backward.per_sample import clipped_sum, linear_per_sample_grads, per_sample_norms

    weight = layer.weight.requires_grad
    bias = layer.bias is not None and layer.bias.requires_grad
    wgrad: list[float] = []

    def weight_grad_ms() -> float:  # what the gradient phase runs for a ghost-norm layer
        if not wgrad:
            a2, g2 = a.reshape(-1, a.shape[-1]).to(g.dtype), g.reshape(-1, g.shape[-1])
            wgrad.append(_clock_ms(lambda: g2.t() @ a2, a.device, repeats) if weight else 0.0)
        return wgrad[0]

    def cost(c: Candidate, with_weight_grad: bool) -> float:
        if c.per_sample:
            scale = torch.ones(a.shape[0], device=a.device, dtype=torch.float32)

            def psg():
                grads = linear_per_sample_grads(layer, a, g)
                per_sample_norms(grads)
                clipped_sum(grads, scale)

            return _clock_ms(psg, a.device, repeats)
        ms = weight_grad_ms() if with_weight_grad else 0.0
        aat = upper_gram(a, c.block) if weight else None
        if weight:
            ms += _clock_ms(lambda: upper_gram(a, c.block), a.device, repeats) / readers
        return ms + _clock_ms(
            lambda: contract_output_grams(aat, g, c.block, bias=bias), a.device, repeats
        )

    return cost
