"""A direct per-sample norm for Llama-style RMSNorm layers (no functorch).

Opacus has no norm sampler for ``LlamaRMSNorm`` and falls back to functorch, which re-runs the
layer per sample, deep-copies it (impossible for an FSDP unit) and reads ``layer.parameters()``
(empty under FSDP1 during backward). For ``y = w * xhat`` with ``xhat`` the normalised input
(computed exactly as the layer does: fp32 variance, cast back to the input dtype), sample n's
weight gradient is ``sum_t dy_t * xhat_t``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: Layer classes (by name) whose forward is ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``.
LLAMA_STYLE_RMSNORM = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


def rms_norm_sample(layer: nn.Module, activations, backprops) -> dict:
    """Per-sample gradient norm of a Llama-style RMSNorm weight."""
    x = activations[0]
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
    xhat = h.to(x.dtype)
    dy = backprops.to(xhat.dtype)
    g = (dy * xhat).reshape(dy.shape[0], math.prod(dy.shape[1:-1]), dy.shape[-1]).sum(dim=1)
    return {layer.weight: g.float().norm(2, dim=-1)}


def rms_norm_samplers(model: nn.Module) -> dict[type, object]:
    """``{class: rms_norm_sample}`` for every Llama-style RMSNorm class used in ``model``."""
    found = {}
    for m in model.modules():
        cls = type(m)
        base = (
            cls.__bases__[1] if cls.__name__.startswith("FSDP") and len(cls.__bases__) > 1 else cls
        )
        if base.__name__ in LLAMA_STYLE_RMSNORM and hasattr(m, "variance_epsilon"):
            found[cls] = rms_norm_sample
            found[base] = rms_norm_sample
    return found
