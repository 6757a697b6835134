"""The final word on exactness: an explicit clip-each-sample loop on one process.

Upstream Opacus is a reference, not the truth (it is silently wrong for tied weights under FSDP2).
These functions compute each sample's full gradient with plain autograd, clip it with Opacus's
coefficient ``min(1, C / (norm + 1e-6))``, and sum or average the clipped gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: ``loss_fn(model, inputs, targets) -> scalar``: the loss of ONE sample (inputs of batch 1).
SampleLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_clipped_grads(
    model: nn.Module,
    loss_fn: SampleLoss,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    max_grad_norm: float,
    loss_reduction: str = "mean",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Clips every sample's whole-model gradient and aggregates them.

    A parameter shared by several modules appears once in ``named_parameters()`` and its
    per-sample gradient is the sum over its uses, as autograd computes it.

    Args:
        model: A plain (unsharded) model.
        loss_fn: Per-sample loss, see :data:`SampleLoss`.
        inputs: Batch of inputs, batch dimension first.
        targets: Batch of targets, batch dimension first.
        max_grad_norm: Clipping bound ``C``.
        loss_reduction: ``"mean"`` divides the sum of clipped gradients by the batch size.

    Returns:
        ``(gradients by parameter name, per-sample norms before clipping)``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in named}
    norms = []
    for i in range(inputs.shape[0]):
        loss = loss_fn(model, inputs[i : i + 1], targets[i : i + 1])
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)]
        norm = torch.sqrt(sum(g.detach().pow(2).sum() for g in grads))
        coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for (n, _), g in zip(named, grads):
            total[n] += coef * g
        norms.append(norm)
    if loss_reduction == "mean":
        total = {n: g / inputs.shape[0] for n, g in total.items()}
    return total, torch.stack(norms)


@torch.no_grad()
def _sgd(model: nn.Module, grads: dict[str, torch.Tensor], lr: float) -> None:
    for n, p in model.named_parameters():
        if n in grads:
            p.sub_(lr * grads[n])


def clip_each_sample_step(
    model: nn.Module,
    loss_fn: SampleLoss,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    max_grad_norm: float,
    lr: float,
    loss_reduction: str = "mean",
) -> torch.Tensor:
    """One noise-free DP-SGD step with plain SGD (no momentum), in place.

    Returns:
        The per-sample gradient norms of the batch before clipping.
    """
    grads, norms = per_sample_clipped_grads(
        model, loss_fn, inputs, targets, max_grad_norm, loss_reduction
    )
    _sgd(model, grads, lr)
    return norms
