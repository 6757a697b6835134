"""Timing the exact Linear norm candidates of :mod:`.tuner` on a layer's real inputs.

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

import torch
from torch import nn

from ..layers.linear import Candidate, LinearRoom


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

    What each candidate costs is the ``Linear`` room's to say
    (:meth:`~opacus_fsdp_sync.layers.linear.LinearRoom.work`); a part that two candidates share
    (the weight-gradient matmul) is timed once.

    Returns:
        ``cost(candidate, with_weight_grad) -> ms``; ``with_weight_grad`` adds the
        weight-gradient matmul to the Gram candidates (when per-sample gradients, which replace
        it, are a candidate too).
    """
    timed: dict[str, float] = {}

    def cost(c: Candidate, with_weight_grad: bool) -> float:
        ms = 0.0
        for name, work, share in LinearRoom.work(
            layer, a, g, c, readers, with_weight_grad=with_weight_grad
        ):
            if name not in timed:
                timed[name] = _clock_ms(work, a.device, repeats)
            ms += timed[name] * share
        return ms

    return cost
